"""Continuous batching over one paged cache (``Engine``), in parts with one job each:

- ``engine.py``: the step loop, requests in and events out;
- ``scheduler.py``: which requests a step computes, and their cache room;
- ``runner.py``: one ragged forward pass of a scheduled batch, and landing its tokens;
- ``sampler.py``: one token per sampling row;
- ``request.py``: a request's state and its events;
- ``proposers.py``: speculative drafts by prompt lookup, and their acceptance;
  ``draft_model.py``: drafts from a smaller model.

The mlx-lm adapter it runs models through is ``kvmetal.integrations``."""
