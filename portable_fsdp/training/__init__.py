"""The training loop and what it reports: the loop, evaluation, metrics and MFU, trackers, the learning-rate
schedule, the loss's chunks and the sequence split every backend shares, and fault injection for tests."""
