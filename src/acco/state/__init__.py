"""The optimizer's state: what a state dict holds, taking it and putting it back, and checking it.

Every path goes down, from :mod:`acco.checkpoint` or the optimizer's ``state_dict()`` / ``load_state_dict()``
to the buffers, and never calls back into the optimizer: the optimizer hands in the owners of its state
(:class:`~acco.state.format.StateOwners`, its :class:`~acco.session.Session` among them).

* :mod:`~acco.state.io`: ``state_dict()`` and ``load_state_dict()``; everything a load refuses, agreed on by
  every rank before anything changes.
* :mod:`~acco.state.format`: what a state dict is (format 3: per parameter, pieces keyed by parameter index and
  first element), its description and the compatibility checks, the hyper-parameters.
* :mod:`~acco.state.pieces`: this rank's pieces: taking them, and putting back any saved set that covers them
  (resharding to another number of ranks).
* :mod:`~acco.state.checksums`: the checksums a checkpoint is verified against.
* :mod:`~acco.state.consolidated`: the wrapped optimizers' own format, every parameter's full state on every rank.
* :mod:`~acco.state.legacy`: format 2 (flat, before per-parameter state), read as format 3.
"""
