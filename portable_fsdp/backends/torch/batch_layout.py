"""The layout of the batch a rank is training on (which tokens its sequence shard holds), as context- and
sequence-parallel attention read it.

It is set around the forward and backward of each micro-batch (`sequence_shard`) and read from whichever thread
runs the attention. That is not always the thread that set it: autograd runs a CUDA backward on a thread of its
own per device, and activation checkpointing recomputes the attention there — where a context variable of the
training thread is unset. So the layout is one value per process, which only the training thread sets.
"""
from __future__ import annotations

import contextlib


class BatchLayout:
    def __init__(self):
        self._layout = None

    def get(self):
        """The layout of the micro-batch in flight, or None outside `active`."""
        return self._layout

    @contextlib.contextmanager
    def active(self, layout):
        """`layout` is the one in flight inside (the previous one again afterwards)."""
        previous, self._layout = self._layout, layout
        try:
            yield
        finally:
            self._layout = previous
