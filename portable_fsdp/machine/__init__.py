"""What this machine is: accelerator datasheets and measured peaks (hardware), the host's cores and memory,
the Cloud TPU VM's metadata, and the GPU machine's packages."""
