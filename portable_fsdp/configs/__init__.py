"""Recipes: `get_config(arg) -> ConfigDict`, installed as portable_fsdp.configs."""
