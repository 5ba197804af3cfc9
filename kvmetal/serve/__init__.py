"""``kvmetal serve``: an OpenAI-compatible HTTP server over the continuous-batching Engine.

Needs the ``serve`` extra (FastAPI + uvicorn). Modules, one job each:

    memory        ``--kv-memory`` parsing and the pool size that stays under it
    worker        the engine thread: the only thread that runs the model
    prefix_store  ``--prompt-cache-dir``: published prefix blocks on disk
    metrics       counters and the ``/metrics`` text
    protocol      OpenAI request fields -> validated generation parameters
    app           the FastAPI routes
    server        build and run them (engine on the main thread, HTTP on another);
                  ``ServerProcess`` for tests and the load script
    distributed   serving across ranks under mlx.launch
    tiny          a tiny model directory with a real tokenizer (tests, load script)
    cli           the ``kvmetal serve`` command line
"""
