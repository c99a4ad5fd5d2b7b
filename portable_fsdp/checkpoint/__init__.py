"""Checkpoints on disk: the layout, manifest and atomic commit (layout), which files a checkpoint has (files),
the session the loop, the API and the benchmarks save and resume through (session), background saves,
checksums and the safetensors shards of FULL weights."""
