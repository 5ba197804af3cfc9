"""Build the engine worker and the app from ``kvmetal serve`` options, and run them.

The engine loop runs on the main thread and uvicorn on a second thread (MLX must stay
on one thread; see ``worker``). SIGINT/SIGTERM shut down gracefully: uvicorn stops
accepting connections at once, the engine lets running requests finish for up to
``--shutdown-timeout`` seconds, then ends the rest with "the server is shutting down"
(an SSE error event, or a 503), the prefix store writes what it holds, and the process
exits 0. A second signal ends the running requests at once.
``ServerProcess`` starts ``kvmetal serve`` as a subprocess (tests, the load script).
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .memory import blocks_under_cap, format_bytes, model_pool_bytes, parse_memory
from .protocol import Defaults

log = logging.getLogger("kvmetal.serve")


def _kv_format(args, model):
    """The cache's KVFormat from the flags (kvmetal.kv_format: the meaning generate and bench give
    them), its group sizes chosen for the model's head_dim; an error names the flag."""
    from ..integrations.mlx_lm import layer_specs
    from ..kv_format import format_from_args

    fmt = format_from_args(args)
    for spec in layer_specs(model):
        fmt.for_head_dim(spec.head_dim)  # every layer: an error names the flag now
    return fmt.for_head_dim(layer_specs(model)[0].head_dim) if fmt.quantized else fmt


def build_server(args, sync=None):
    """Load the model, size the pool, load the prefix store; returns (worker, app), ready to run.

    With ``sync`` (serving across ranks) the model is loaded sharded over its group and
    the pool takes rank 0's size; every rank calls this, in the same order."""
    from ..engine.engine import Engine
    from .app import Limits, ServeState, create_app
    from .prefix_store import PrefixStore, model_identity
    from .worker import EngineWorker

    model_dir = Path(args.model)
    cap = parse_memory(args.kv_memory) if args.kv_memory else None
    from ..kv_format import format_from_args

    format_from_args(args)  # the flags alone, before the model loads
    loaded = {}

    def build():
        from mlx_lm import load

        config = {"chat_template": args.chat_template} if args.chat_template else {}
        if sync is None:
            model, tokenizer = load(str(model_dir), tokenizer_config=config)
        else:
            from mlx_lm.utils import sharded_load

            model, tokenizer = sharded_load(str(model_dir), tensor_group=sync.group, tokenizer_config=config or None)
        loaded["tokenizer"] = tokenizer
        num_blocks = None
        options = dict(block_size=args.block_size, kv_format=_kv_format(args, model))
        if cap is not None:  # a cap per rank: each rank's pools hold its own kv heads
            num_blocks = blocks_under_cap(lambda n: model_pool_bytes(model, n, **options), cap,
                                          block_size=args.block_size)
        if sync is not None:
            num_blocks = sync.share_int(num_blocks)  # identical pools, identical block tables
        loaded["num_blocks"] = num_blocks
        draft = None
        if getattr(args, "speculative", None) not in (None, "ngram"):
            draft, draft_tokenizer = load(args.speculative)
            if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
                raise ValueError(f"--speculative {args.speculative}: its tokenizer differs from the served model's; "
                                 f"a draft model must share it")
        engine = Engine(model, num_blocks=num_blocks, prefix_sharing=False if args.no_prefix_sharing else None,
                        keep_finished=False, max_num_batched_tokens=args.max_num_batched_tokens,
                        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
                        scheduler_options=dict(long_prefill_tokens=getattr(args, "long_prefill_tokens", None)),
                        async_steps=not getattr(args, "sync_steps", False), cascade=getattr(args, "cascade", False),
                        speculative=speculative_config(args), draft_model=draft, **options)
        if sync is not None:
            engine.token_sync = sync.share_tokens
        return engine

    store_factory = None
    if args.prompt_cache_dir:
        def store_factory(engine):
            return PrefixStore(args.prompt_cache_dir, model_identity(model_dir), engine.cache,
                               max_bytes=getattr(args, "prompt_cache_max_bytes", None), background_writes=True)

    worker = EngineWorker(build, prefix_store_factory=store_factory, kv_cap_bytes=cap, sync=sync)
    worker.setup()
    engine = worker.engine
    if cap is not None:
        log.info("KV cap %s: %d blocks of %d tokens per layer-group pool, %s allocated", format_bytes(cap),
                 loaded["num_blocks"], args.block_size, format_bytes(engine.cache.nbytes))
    else:
        log.info("no --kv-memory cap: the KV pool grows on demand")
    if worker.store is not None:
        log.info("prompt cache %s: %d blocks loaded", worker.store.root, worker.store.loaded_blocks)
    context_limit = None
    with contextlib.suppress(OSError, ValueError):
        context_limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    template_kwargs = json.loads(args.chat_template_args) if args.chat_template_args else {}
    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                        min_p=args.min_p)
    limits = Limits(api_key=api_key(args), max_body_bytes=getattr(args, "max_body_bytes", None),
                    max_queue=getattr(args, "max_queue", None),
                    max_queued_prompt_tokens=getattr(args, "max_prompt_tokens", None),
                    timeout=getattr(args, "timeout", None))
    model_id = getattr(args, "model_name", None) or model_dir.name  # what /v1/models lists
    state = ServeState(worker, loaded["tokenizer"], model_id, defaults, context_limit, template_kwargs, limits,
                       model_path=str(model_dir))
    return worker, create_app(state)


def speculative_config(args):
    """The engine's ``SpeculativeConfig`` from the flags (None: off)."""
    if not getattr(args, "speculative", None):
        return None
    from ..engine.proposers import SpeculativeConfig

    method = "ngram" if args.speculative == "ngram" else "model"  # else a draft model's directory
    return SpeculativeConfig(method=method, num_draft_tokens=args.num_draft_tokens,
                             ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                             min_acceptance=args.spec_min_acceptance)


def api_key(args) -> str | None:
    """``--api-key``, else ``KVMETAL_API_KEY``, else None (no key asked)."""
    return getattr(args, "api_key", None) or os.environ.get("KVMETAL_API_KEY") or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_warning(host: str, key: str | None) -> str | None:
    """What to warn about when ``host`` reaches beyond this machine and no key is asked."""
    if is_loopback(host) or key:
        return None
    return (f"serving on {host}, beyond this machine, without an API key: anyone who can reach it can use it; "
            f"set --api-key or KVMETAL_API_KEY")


def _http_protocol():
    """uvicorn's h11 protocol, plus a timeout for a connection that never sends a byte
    (uvicorn times out idle keep-alive connections only after a first request)."""
    try:
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:  # pragma: no cover - another uvicorn layout: its default protocol
        return "auto"

    class FirstByteTimeout(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            if hasattr(self, "timeout_keep_alive_handler"):
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

    return FirstByteTimeout


def run(args) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    backend = contextlib.nullcontext()
    if args.backend:
        from ..backends import use_backend

        backend = use_backend(args.backend)
    with backend:
        from ..commands.common import distributed_group
        from .distributed import RankSync

        group = distributed_group()
        sync = None
        if group is not None:
            if args.prompt_cache_dir:
                raise ValueError("--prompt-cache-dir is not supported across ranks yet")
            sync = RankSync(group, timeout_s=args.rank_timeout)
            log.info("rank %d of %d (pid %d)", sync.rank, sync.size, os.getpid())
        worker, app = build_server(args, sync)
        if sync is not None and not sync.leader:
            return _follow(worker)
        warning = bind_warning(args.host, api_key(args))
        if warning:
            log.warning("%s", warning)
        grace = getattr(args, "shutdown_timeout", 10.0)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, http=_http_protocol(),
                                               log_level=args.log_level.lower(),
                                               timeout_graceful_shutdown=grace + 5))
        http_failed = []

        def serve_http():
            try:
                server.run()
            except BaseException as e:  # uvicorn exits (SystemExit) when it cannot bind
                http_failed.append(e)
            finally:
                if not server.should_exit:  # HTTP ended on its own: nothing can reach the engine
                    http_failed.append(RuntimeError("the HTTP server stopped"))
                    worker.stop()

        http = threading.Thread(target=serve_http, name="kvmetal-http", daemon=True)

        def shutdown(signum, _frame):
            if worker.stopping:
                log.info("signal %d again: ending the running requests now", signum)
            else:
                log.info("signal %d: no new connections; running requests get up to %g s", signum, grace)
            server.should_exit = True  # uvicorn closes its sockets, then waits for open connections
            worker.shutdown(grace)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, shutdown)
        http.start()
        try:
            worker.serve_forever()  # returns after stop(), or if the engine loop died
        finally:
            server.should_exit = True
            http.join(timeout=15)  # the handlers send what the engine ended them with
    if http_failed:
        log.error("kvmetal serve: could not serve HTTP on %s:%d", args.host, args.port)
        return 1
    return 1 if worker.failed else 0


def _follow(worker) -> int:
    """Ranks other than 0: run rank 0's commands until it says stop (or a rank dies)."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop, and tells every rank
        signal.signal(sig, signal.SIG_IGN)
    worker.serve_forever()
    return 1 if worker.failed else 0


class ServerProcess:
    """``kvmetal serve`` in a subprocess on ``port``; ``start()`` waits for ``/health``.

    ``command``: run this instead (``model_dir`` and ``options`` are then unused); it must
    serve on ``host``:``port`` and answer ``GET /health`` (``mlx_lm.server`` does).
    ``start_timeout``: the default wait of ``start()`` (and of ``with``)."""

    def __init__(self, model_dir, port: int, *options, host: str = "127.0.0.1", log_path=None,
                 command: list | None = None, start_timeout: float = 120):
        self.url = f"http://{host}:{port}"
        self.command = list(command) if command is not None else [
            sys.executable, "-m", "kvmetal", "serve", "--model", str(model_dir), "--host", host,
            "--port", str(port), *map(str, options)]
        self.start_timeout = start_timeout
        self.log_path = log_path
        self.proc = None
        self.output = ""

    def start(self, timeout: float | None = None) -> "ServerProcess":
        import httpx

        import tempfile

        # A file, not a pipe: nobody reads a pipe while the server runs, and a full pipe blocks it.
        self._log = open(self.log_path, "w+") if self.log_path else tempfile.TemporaryFile("w+")
        # Run from where this process found kvmetal: ``-m`` puts the working directory first on
        # sys.path, and a source tree without its built extension there would shadow the install.
        here = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, text=True,
                                     cwd=here, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start ({' '.join(self.command)}):\n{self.output[-3000:]}")
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait; returns the exit status (the output is in ``self.output``)."""
        if self.proc is None:
            return 0
        if self._log.closed:  # stopped already
            return self.proc.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.seek(0)
        self.output = self._log.read()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False
