"""Data: text sources, tokenizers and the deterministic, resumable packed-batch loader (numpy only)."""
