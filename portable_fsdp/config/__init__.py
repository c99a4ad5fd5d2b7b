"""The run's configuration: the schema and its recipes' loading (schema), what Hugging Face TrainingArguments
and fsdp_config files mean here (hf_import), an Accelerate YAML's launch keys (accelerate), and the
checks that turn a config into a validated plan (validate)."""
