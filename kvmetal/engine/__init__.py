"""Continuous batching over one paged cache (``Engine``), in parts with one job each:

- ``engine.py``: the step loop, requests in and events out;
- ``scheduler.py``: which requests a step computes, and the one owner of cache room;
- ``runner.py``: one ragged forward pass of a scheduled batch, and landing its tokens;
- ``sampler.py``: one token per sampling row, and the speculative acceptance rule;
- ``request.py``: a request's state, its events, its argument checks;
- ``proposers.py``: speculative drafts (prompt lookup, a draft model).

The mlx-lm adapter it runs models through is ``kvmetal.integrations``."""
