"""The ``semantic`` command line: one subcommand a task (``semantic --help`` lists them)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from app import __version__
from app.errors import ConfigError, InvalidModelFile, NotFound, SemanticError
from app.logs import configure_logging
from app.redaction import redact, shown_setting
from app.setting_flags import add_setting_flags, setting_overrides
from app.settings import Settings, config_file, load_settings


def _keep_private(home: Path) -> None:
    """What Semantic writes is its user's alone: every message is in the history database
    and every conversation's text in its cache record files. New files are 0600 and
    directories 0700 (umask); the home and the database files an earlier version left
    readable to others are closed too (only if this user owns them)."""
    os.umask(0o077)
    for path in (home, *(home / f"semantic.db{suffix}" for suffix in ("", "-wal", "-shm"))):
        try:
            if path.stat().st_uid == os.geteuid() and path.stat().st_mode & 0o077:
                path.chmod(0o700 if path.is_dir() else 0o600)
        except FileNotFoundError:
            continue


def cmd_serve(settings: Settings, _args: argparse.Namespace) -> int:
    from app.main import serve

    code = 0
    try:
        serve(settings)
    except SemanticError as exc:
        print(f"semantic: error: {redact(str(exc))}", file=sys.stderr)
        code = 2
    # Everything is stopped and written by now. Exit without running static destructors:
    # MLX's CPU backend sometimes aborts in them (std::terminate on a joinable thread),
    # which would turn a clean Ctrl-C or SIGTERM into exit status 134.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    from worker.main import run_worker

    run_worker(settings, workers=args.workers)
    return 0


def cmd_jobs_run(settings: Settings, args: argparse.Namespace) -> int:
    from app.store.db import upgrade

    upgrade(settings.db_url)
    from worker.tasks import JOBS

    job = JOBS[args.name]
    try:
        result = job.call_local()
    except Exception as exc:  # recorded in job_runs as an error by the job's wrapper
        print(f"semantic: job {args.name} failed: {type(exc).__name__}: {redact(str(exc))}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


def cmd_sql(settings: Settings, args: argparse.Namespace) -> int:
    from app.store.readonly import format_table, run_readonly, run_readonly_postgres

    result = (run_readonly_postgres(settings.database_url, args.query) if settings.database_url
              else run_readonly(settings.db_path, args.query))
    print(format_table(*result))
    return 0


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    from app.status import collect, format_json, format_report, server_url

    report = collect(settings, (args.url or server_url(settings)).rstrip("/"))
    print(format_json(report) if args.json else format_report(report))
    return 0 if report.health is not None and report.health.get("status") == "ok" else 1


def cmd_chat(settings: Settings, args: argparse.Namespace) -> int:
    from app.chat import ChatClient, ask_once, run
    from app.status import server_url
    from app.types import SESSION_ID_PATTERN

    client = ChatClient((args.url or server_url(settings)).rstrip("/"), settings.api_key or None)
    agent, question = args.agent, args.question
    if question is None and agent is not None and not re.fullmatch(SESSION_ID_PATTERN, agent):
        agent, question = None, agent  # `semantic chat "a question"`: not an agent's id
    if question is not None:
        return ask_once(client, agent, question, system_prompt=args.system, max_tokens=args.max_tokens,
                        temperature=args.temperature)
    return run(client, agent, system_prompt=args.system, max_tokens=args.max_tokens,
               temperature=args.temperature, history=settings.home / "chat_history")


def cmd_launch(settings: Settings, args: argparse.Namespace) -> int:
    from app import launch
    from app.status import read_health, server_url

    url = (args.url or server_url(settings)).rstrip("/")
    health = read_health(url, settings.api_key)
    context = health.get("context_length") if health else None
    planned = launch.plan(args.client, url, settings.home, settings.api_key or None, args.model, args.args, args.bin,
                          context_length=context if isinstance(context, int) else None)
    if args.print:
        print(planned.shown())
        return 0
    if health is None:
        print(f"semantic launch: no server answers at {url}; start one with ./scripts/serve (or semantic serve)",
              file=sys.stderr)
        return 1
    launch.run(planned)
    return 0  # not reached: the client replaced this process


def cmd_config(settings: Settings, _args: argparse.Namespace) -> int:
    import os

    source = config_file(os.environ)
    print(f"# effective settings (file: {source or 'none'}; SEMANTIC_* variables override it)")
    for name, value in settings.as_dict().items():
        value = shown_setting(name, str(value) if isinstance(value, Path) else value)  # ends up in bug reports
        print(f"{name} = {json.dumps(value)}")
    return 0


def _store(settings: Settings):  # type: ignore[no-untyped-def]
    """Sessions on the home's database (migrated to head) and the shared tier if there is one."""
    from app.cache.shared_tier import S3Tier
    from app.store.db import make_engine, make_session_factory, upgrade

    upgrade(settings.db_url)
    return make_session_factory(make_engine(settings.db_url)), S3Tier(settings.block_store) if settings.block_store \
        else None


def cmd_agents_export(settings: Settings, args: argparse.Namespace) -> int:
    from app.agents.portable import export_agent

    if args.output == "-" and sys.stdout.isatty():
        print("semantic: error: the export is a binary file: redirect it (> agent.tar) or give -o FILE",
              file=sys.stderr)
        return 2
    sessions, tier = _store(settings)
    if args.output == "-":
        manifest = export_agent(sessions, settings.blocks_dir, args.agent_id, sys.stdout.buffer, tier)
    else:
        partial = Path(f"{args.output}.partial")
        try:
            with partial.open("wb") as out:
                manifest = export_agent(sessions, settings.blocks_dir, args.agent_id, out, tier)
            partial.replace(args.output)
        finally:
            partial.unlink(missing_ok=True)
    n_messages = sum(len(c["messages"]) for c in manifest["conversations"])
    n_tokens = sum(cache["n_tokens"] for c in manifest["conversations"] for cache in c["caches"])
    print(f"exported agent {args.agent_id!r}: {len(manifest['conversations'])} conversation(s), {n_messages} "
          f"messages, {n_tokens} cached tokens in {len(manifest['files'])} files, {len(manifest['requests'])} "
          f"request rows, {len(manifest['responses'])} stored responses", file=sys.stderr)
    return 0


def cmd_agents_import(settings: Settings, args: argparse.Namespace) -> int:
    from app.agents.portable import import_agent

    if args.file != "-" and not Path(args.file).is_file():
        print(f"semantic: error: {args.file}: no such file", file=sys.stderr)
        return 2
    sessions, tier = _store(settings)
    with (sys.stdin.buffer if args.file == "-" else open(args.file, "rb")) as source:
        result = import_agent(sessions, settings.blocks_dir, source, args.new_id, tier)
    print(f"imported agent {result.agent_id!r}: {result.n_conversations} conversation(s), {result.n_messages} "
          f"messages, {result.n_cached_tokens} cached tokens ({result.n_blocks_new} new block files), "
          f"{result.n_requests} request rows, {result.n_responses} stored responses"
          + (f" ({result.n_log_skipped} rows left out: their ids are this store's already)"
             if result.n_log_skipped else ""))
    return 0


def cmd_models_import(settings: Settings, args: argparse.Namespace) -> int:
    from app.catalog.gguf_import import ImportOptions, import_gguf
    from app.catalog.gguf_stores import find as find_stored
    from app.catalog.gguf_stores import import_name, is_store_name
    from app.catalog.registry import model_destination
    from app.engine.blas import load_fast_blas

    load_fast_blas(settings.blas_library)  # the import builds mlx-lm's model of the family

    if is_store_name(args.file):  # ollama:MODEL[:TAG], lmstudio:PUBLISHER/REPOSITORY[/FILE]
        source = find_stored(args.file).path
        name = args.name or import_name(args.file)
    else:
        source = Path(args.file)
        name = args.name or source.name.removesuffix(".gguf").lower()
    destination = model_destination(settings.models_dir, name)
    options = ImportOptions(dtype=args.dtype, quantize_bits=args.quantize, group_size=args.group_size,
                            max_shard_bytes=int(args.shard_gb * (1 << 30)))
    result = import_gguf(source, destination, options)
    weights = f"{result.quantize_bits}-bit + {result.dtype}" if result.quantize_bits else result.dtype
    print(f"imported {result.architecture} model {name!r}: {result.n_tensors} tensors, "
          f"{result.n_params / 1e6:.1f}M parameters, {weights}, {result.n_shards} shard(s) -> {result.path}")
    _calibrate(settings, name, result.path)
    return 0


def cmd_models_install(settings: Settings, args: argparse.Namespace) -> int:
    from app.catalog.embedded import EMBEDDED, install_packages
    from app.catalog.registry import ensure_embedded
    from app.engine.blas import load_fast_blas

    load_fast_blas(settings.blas_library)  # the import builds mlx-lm's model of the family

    installed = install_packages(EMBEDDED[args.name])
    print(f"{args.name}: installed {' '.join(installed)}" if installed else f"{args.name}: its package is installed")
    path = ensure_embedded(settings.models_dir, args.name)
    print(f"{args.name}: {path}")
    _calibrate(settings, args.name, path)
    return 0


def cmd_models_pull(settings: Settings, args: argparse.Namespace) -> int:
    from app.catalog.hf_cache import view
    from app.catalog.hf_pull import pull
    from app.catalog.registry import hf_views

    model = pull(args.repo_id)
    print(f"{model.repo_id}: {model.snapshot} (commit {model.commit[:12]}); "
          f"serve it with: semantic serve --model {model.repo_id}")
    _calibrate(settings, model.repo_id, view(model, hf_views(settings.models_dir)))
    return 0


def cmd_models_rm(settings: Settings, args: argparse.Namespace) -> int:
    from app.catalog import hf_cache
    from app.catalog.embedded import EMBEDDED
    from app.catalog.registry import forget_hf_model, remove_model

    name = args.name
    configured = _configured_as(settings, name)
    if configured and not args.force:
        raise ConfigError(f"{name} is configured ({', '.join(configured)}): change the configuration first, "
                          "or pass --force")
    if hf_cache.is_repo_id(name):
        where = hf_cache.repo_folder(name, hf_cache.hub_cache())
        if not where.is_dir():
            raise NotFound(f"model {name!r} is not in the Hugging Face cache {hf_cache.hub_cache()}")
        if not args.hf_cache:
            print(f"semantic: {name} is in the Hugging Face cache ({where}), which Semantic only reads; "
                  f"remove it with `hf cache rm model/{name}`, or with `semantic models rm {name} --hf-cache`",
                  file=sys.stderr)
            return 1
        freed = hf_cache.delete_from_cache(name)
        forget_hf_model(settings.models_dir, name)
        print(f"removed {name} from the Hugging Face cache ({where}, {freed / 1e6:.1f} MB freed)")
        return 0
    path = remove_model(settings.models_dir, name)
    again = f"; `semantic models install {name}` imports it again" if name in EMBEDDED else ""
    print(f"removed {name} ({path}){again}")
    return 0


def _configured_as(settings: Settings, name: str) -> list[str]:
    """The settings that name model ``name`` (a repo id, or a model under the home)."""
    from app.catalog.registry import model_path

    named = [("model", settings.model), *((f"model_aliases.{a}", t) for a, t in settings.model_aliases.items())]
    return [key for key, given in named
            if given == name or model_path(settings.models_dir, given) == settings.models_dir / name]


def _calibrate(settings: Settings, name: str, path: Path) -> None:
    """Measure the ``auto`` KV format of a new model now rather than at its first load."""
    if settings.kv_format_for(name) != "auto":
        return
    from app.engine.blas import load_fast_blas

    load_fast_blas(settings.blas_library)
    from tqdm import tqdm

    from app.engine.calibration import n_steps
    from app.engine.model import ensure_calibrated, kv_choice

    kv = kv_choice(path, "auto")
    if kv.chosen_by == "pending":
        with tqdm(total=n_steps(), desc=f"calibrate the KV format of {name}", unit="step") as bar:
            def step(label: str) -> None:
                bar.set_postfix_str(label)
                bar.update()

            kv = ensure_calibrated(name, path, settings.dtype, step)
            bar.total = bar.n  # it stops at the first size that meets the goal
    print(f"{name}: KV format {kv.describe()}")


def cmd_models_calibrate(settings: Settings, args: argparse.Namespace) -> int:
    from app.catalog.registry import configured_model_dir
    from app.engine.blas import load_fast_blas

    load_fast_blas(settings.blas_library)  # an embedded model not imported yet is imported first
    path = configured_model_dir(settings.models_dir, args.name)
    if settings.kv_format_for(args.name) != "auto":
        print(f"{args.name}: its KV format is set ({settings.kv_format_for(args.name)}), not calibrated")
        return 0
    _calibrate(settings, args.name, path)
    return 0


def cmd_models_list(settings: Settings, _args: argparse.Namespace) -> int:
    from app.catalog.embedded import EMBEDDED
    from app.catalog.gguf_stores import import_name, stored_models
    from app.catalog.registry import list_hf_models, list_models
    from app.engine.backend import weights_bytes
    from app.engine.blas import load_fast_blas

    load_fast_blas(settings.blas_library)
    from app.engine.model import kv_choice

    installed = {m.name: m for m in list_models(settings.models_dir)}
    print("NAME\tARCHITECTURE\tSOURCE\tPATH\tKV FORMAT\tWEIGHTS")
    for model in (*installed.values(), *list_hf_models(settings.models_dir)):
        default = " (default)" if model.name == settings.model else ""
        try:
            kv = f"KV {kv_choice(model.path, settings.kv_format_for(model.name)).describe()}"
        except InvalidModelFile as exc:  # a pinned format that cannot store its heads: it will not load
            kv = f"KV refused: {exc}"
        print(f"{model.name}\t{model.architecture}\t{model.source}\t{model.path}{default}\t{kv}\t"
              f"{_size(weights_bytes(model.path))}")
    for name, embedded in EMBEDDED.items():
        if name not in installed:
            package = "package installed" if not embedded.missing_packages else f"semantic models install {name}"
            print(f"{name}\tnot imported\tembedded, from {embedded.packages[0]} ({package})\t{embedded.description}")
    for stored in stored_models():
        imported = import_name(stored.name)
        state = f"imported as {imported}" if imported in installed else f"semantic models import {stored.name}"
        print(f"{stored.name}\t{_architecture(stored.path)}\t{stored.source} ({state})\t{stored.path}")
    for alias, target in settings.model_aliases.items():
        print(f"{alias}\talias\t{target}")
    return 0


def _architecture(gguf_path: Path) -> str:
    """A GGUF file's architecture, or why it cannot be read."""
    from app.catalog.gguf_import import GgufFile

    try:
        return GgufFile(gguf_path).architecture
    except InvalidModelFile:
        return "unreadable GGUF"


def _size(n_bytes: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n_bytes < 1000:
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    return f"{n_bytes:.1f} GB"


def cmd_pool_up(settings: Settings, args: argparse.Namespace) -> int:
    from app.pool.supervisor import pool_up

    return pool_up(settings, args.servers, args.port or settings.port, args.routing)


def cmd_pool_status(settings: Settings, args: argparse.Namespace) -> int:
    from app.pool.supervisor import pool_status

    rows = pool_status(settings)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            state = "healthy" if row["healthy"] else "DOWN"
            print(f"{row['id']}\t{row['url']}\tpid {row['pid']}\t{state}\t{row['agents_hot']} agents in memory")
    return 0 if all(row["healthy"] for row in rows) else 1


def cmd_pool_router_config(settings: Settings, args: argparse.Namespace) -> int:
    from app.pool.haproxy import Backend, render_config

    backends = []
    for item in args.server:
        name, sep, address = item.partition("=")
        host, colon, port = address.rpartition(":")
        if not sep or not colon or not port.isdigit() or not name:
            raise ConfigError(f"--server: expected ID=HOST:PORT, got {item!r}")
        backends.append(Backend(name, host, int(port)))
    print(render_config(args.port or settings.port, backends, args.admin_socket, host=args.bind,
                        routing=args.routing), end="")
    return 0


def cmd_pool_down(settings: Settings, _args: argparse.Namespace) -> int:
    from app.pool.supervisor import pool_down

    pool_down(settings)
    return 0


def cmd_pool_join(settings: Settings, args: argparse.Namespace) -> int:
    from app.pool.supervisor import pool_join, pool_join_router

    if args.router:
        if not args.address:
            raise ConfigError("pool join --router: --address HOST:PORT (how the router reaches this server)")
        if args.id:
            settings = settings.model_copy(update={"server_id": args.id})
        entry = pool_join_router(settings, args.router, args.address)
        print(f"server {entry.id} joined the router at {args.router} as {entry.url}: it takes new agents; "
              "placed ones stay")
        return 0
    if args.address or args.id:
        raise ConfigError("pool join: --address and --id go with --router (a pool over several machines)")
    entry = pool_join(settings)
    print(f"server {entry.id} joined on {entry.url} (pid {entry.pid}): it takes new agents; placed ones stay")
    return 0


def cmd_pool_drain(settings: Settings, args: argparse.Namespace) -> int:
    from app.pool.supervisor import pool_drain, pool_drain_router

    if args.router:
        if pool_drain_router(settings, args.server_id, args.router):
            print(f"server {args.server_id} drained: its caches are in the shared tier, its agents released")
        else:
            print(f"server {args.server_id} gets no new request from the router at {args.router}; "
                  "stop it on its host (SIGTERM: its caches are flushed, its agents released)")
        return 0
    pool_drain(settings, args.server_id)
    print(f"server {args.server_id} drained: its caches are in the shared tier, its agents released")
    return 0


DESCRIPTION = "Semantic: a local LLM inference server with persistent per-agent KV caches."
EPILOG = """\
examples:
  semantic serve --port 8080         serve the default model on 127.0.0.1:8080
  semantic status --json             the running server, its caches and jobs, as JSON
  semantic sql "SELECT * FROM agent_turns LIMIT 5"

Each command has its own --help. Settings: `semantic config` prints them; each is a key of
$SEMANTIC_HOME/config.toml, a SEMANTIC_* variable and a flag of `semantic serve` (port:
port = 8080, SEMANTIC_PORT=8080, --port 8080; `semantic serve --help` lists them)."""
# MLX is a dependency on macOS only: elsewhere it comes with the extra for the machine (pyproject.toml).
MLX_MISSING = ("MLX is not installed; install Semantic with the extra for this machine: "
               "pip install 'semantic[cpu]' (no GPU) or 'semantic[cuda]' (NVIDIA GPU)")
# worker.tasks.JOBS, named here because importing it takes a second (a test keeps them equal).
JOBS = ("expire", "evict", "compact", "prune", "tier_gc")
# What `semantic sql` reads besides alembic_version (a test keeps them equal to the migrated schema).
SQL_TABLES = ("agents", "conversations", "messages", "requests", "responses", "caches", "cache_blocks", "blocks",
              "owners", "job_runs")
SQL_VIEWS = ("agent_turns", "conversation_turns", "agent_cache_hits", "cache_misses", "tokens_per_day")


def build_parser() -> argparse.ArgumentParser:
    from app.catalog.embedded import EMBEDDED

    parser = argparse.ArgumentParser(prog="semantic", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"semantic {__version__}")
    commands = parser.add_subparsers(dest="command", required=False, title="commands", metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="serve the HTTP API (and run the worker beside it)", usage="%(prog)s [--SETTING VALUE ...]",
        description="Serve the HTTP API on the configured host and port, with the worker as a child process. "
                    "Every setting is a flag here (below), a SEMANTIC_* variable and a key of config.toml.",
        epilog="example: semantic serve --port 8080 --model mlx-community/Qwen2.5-0.5B-Instruct-4bit --max-batch 4 "
               "--no-worker")
    add_setting_flags(serve)
    serve.set_defaults(handler=cmd_serve)

    worker = commands.add_parser("worker", help="run the worker alone (expire, evict, compact, prune)")
    worker.add_argument("--workers", type=int, default=1, help="consumer threads (default 1)")
    worker.set_defaults(handler=cmd_worker)

    jobs = commands.add_parser("jobs", help="run a worker job now")
    job_commands = jobs.add_subparsers(dest="jobs_command", required=False, title="commands", metavar="COMMAND")
    run = job_commands.add_parser("run", help="run one job now and print its result",
                                  epilog="example: semantic jobs run compact")
    run.add_argument("name", choices=JOBS, metavar="JOB", help=f"one of: {', '.join(JOBS)}")
    run.set_defaults(handler=cmd_jobs_run)

    sql = commands.add_parser("sql", help="read-only SQL over the history (writes are refused)",
                              epilog='example: semantic sql "SELECT agent_id, COUNT(*) FROM messages GROUP BY 1"')
    sql.add_argument("query", metavar="QUERY", help=f"a SELECT over the tables ({', '.join(SQL_TABLES)}) "
                                                   f"and views ({', '.join(SQL_VIEWS)})")
    sql.set_defaults(handler=cmd_sql)

    commands.add_parser("config", help="print the effective settings").set_defaults(handler=cmd_config)
    status = commands.add_parser("status", help="the running server, its caches, disk use and jobs")
    status.add_argument("--url", help="the server to ask (default: the configured host and port)")
    status.add_argument("--json", action="store_true", help="print the report as JSON")
    status.set_defaults(handler=cmd_status)

    chat = commands.add_parser("chat", help="talk to an agent of the running server in the terminal",
                               epilog='in the chat: /new [ID], /agents, /help, /quit; """ for a block of lines; '
                                      'Ctrl-C stops a reply. example: semantic chat "What is the capital of France?" '
                                      '(answers once)')
    chat.add_argument("agent", nargs="?", metavar="AGENT",
                      help="the agent to talk to, created if missing (default: a new one); "
                           "text that is no agent id is a question")
    chat.add_argument("question", nargs="?", metavar="QUESTION",
                      help="answer this once and exit, as `ollama run MODEL QUESTION` does")
    chat.add_argument("--system", metavar="TEXT", help="the system prompt of an agent this creates")
    chat.add_argument("--max-tokens", type=int, default=512, metavar="N", help="the longest reply (default 512)")
    chat.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default: the server's)")
    chat.add_argument("--url", help="the server to talk to (default: the one serving this home)")
    chat.set_defaults(handler=cmd_chat)

    launch = commands.add_parser(
        "launch", help="run Claude Code or Codex against the running server",
        usage="semantic launch [-h] [--model MODEL] [--bin PATH] [--url URL] [--print] {claude,codex} [-- ARGS ...]",
        epilog="example: semantic launch claude -- -p 'say hello'   (arguments after -- go to the client)")
    launch.add_argument("client", choices=("claude", "codex"), help="the agent CLI to run")
    launch.add_argument("--model", help="the model name the client asks for (default: the client's own)")
    launch.add_argument("--bin", metavar="PATH", help="the client's executable (default: found on the PATH)")
    launch.add_argument("--url", help="the server (default: the one serving this home)")
    launch.add_argument("--print", action="store_true", help="print the configuration and command, run nothing")
    launch.set_defaults(handler=cmd_launch, args=[])

    pool = commands.add_parser("pool", help="run several servers on this machine as one (docs/pool.md)")
    pool_commands = pool.add_subparsers(dest="pool_command", required=False, title="commands",
                                        metavar="COMMAND")
    up = pool_commands.add_parser("up", help="start PostgreSQL, N servers, a worker and the router; "
                                             "stay in the foreground (Ctrl-C or `pool down` stops all)")
    up.add_argument("--servers", type=int, default=2, help="servers to run (default 2)")
    up.add_argument("--port", type=int, help="the router's port (default: the port setting, 8000); "
                                             "servers take the next ones")
    up.add_argument("--routing", default="affinity", choices=["affinity", "round-robin"],
                    help="affinity (default): each agent to the server holding its cache; round-robin: "
                         "ignore the agent, as a generic load balancer does (a benchmark baseline)")
    up.set_defaults(handler=cmd_pool_up)
    pool_status = pool_commands.add_parser("status", help="each server of the running pool: id, url, pid, health")
    pool_status.add_argument("--json", action="store_true", help="as JSON")
    pool_status.set_defaults(handler=cmd_pool_status)
    pool_commands.add_parser("down", help="stop the running pool").set_defaults(handler=cmd_pool_down)
    join = pool_commands.add_parser(
        "join", help="start one more server and add it to the running router",
        epilog="examples: semantic pool join   (a pool that `pool up` runs here)\n"
               "  semantic pool join --router 10.0.0.3:9999 --address 10.0.0.7:8000 --id s3   (from another host)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    join.add_argument("--router", metavar="HOST:PORT",
                      help="the router's runtime API over TCP (router-config --admin-socket HOST:PORT): "
                           "join from this host")
    join.add_argument("--address", metavar="HOST:PORT",
                      help="with --router: how the router reaches this server; one is started on that port "
                           "(serve --host 0.0.0.0) unless one answers there")
    join.add_argument("--id", help="with --router: the server id of the server started (default: server_id)")
    join.set_defaults(handler=cmd_pool_join)
    drain = pool_commands.add_parser(
        "drain", help="take a server out: no new work, its caches flushed to the shared tier, its agents released",
        epilog="example: semantic pool drain s1")
    drain.add_argument("server_id", metavar="ID", help="the server's id (semantic pool status)")
    drain.add_argument("--router", metavar="HOST:PORT",
                       help="the router's runtime API over TCP (a pool over several machines): the server gets "
                            "no new request, and is stopped if `pool join --router` started it from this home")
    drain.set_defaults(handler=cmd_pool_drain)
    router = pool_commands.add_parser(
        "router-config", help="print the HAProxy configuration for servers on other machines",
        epilog="example: semantic pool router-config --server s1=10.0.0.5:8000 --server s2=10.0.0.6:8000 "
               "--bind 0.0.0.0 --port 8000 > /etc/haproxy/haproxy.cfg")
    router.add_argument("--server", action="append", required=True, metavar="ID=HOST:PORT",
                        help="a server of the pool (its server_id and address); repeat for each")
    router.add_argument("--port", type=int, help="the router's port (default: the port setting, 8000)")
    router.add_argument("--bind", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    router.add_argument("--admin-socket", default="/run/haproxy/semantic-admin.sock",
                        help="HAProxy's runtime API socket: a path, or HOST:PORT over TCP (no authentication: "
                             "bind it to the router host's private address; `pool join --router` uses it)")
    router.add_argument("--routing", default="affinity", choices=["affinity", "round-robin"])
    router.set_defaults(handler=cmd_pool_router_config)

    agents = commands.add_parser("agents", help="move an agent to another home, server or machine, warm")
    agent_commands = agents.add_subparsers(dest="agents_command", required=False, title="commands", metavar="COMMAND")
    export = agent_commands.add_parser(
        "export", help="write one agent (identity, history, cache files) as one portable file",
        epilog="example: semantic agents export planner > planner.tar")
    export.add_argument("agent_id", metavar="ID")
    export.add_argument("-o", "--output", default="-", help="the file to write (default: standard output)")
    export.set_defaults(handler=cmd_agents_export)
    imported = agent_commands.add_parser(
        "import", help="add an exported agent to this home, verified first (warm on its next turn)",
        epilog="example: semantic agents import planner.tar --as planner-copy")
    imported.add_argument("file", help="the exported file (- for standard input)")
    imported.add_argument("--as", dest="new_id", help="import under another agent id")
    imported.set_defaults(handler=cmd_agents_import)

    models = commands.add_parser("models", help="import, install, pull, remove and list models")
    model_commands = models.add_subparsers(dest="models_command", required=False, title="commands",
                                           metavar="COMMAND")
    imp = model_commands.add_parser(
        "import", help="convert a GGUF file into a model directory",
        epilog="examples: semantic models import ./model.gguf --name my-model --quantize 8; "
               "semantic models import ollama:qwen2.5-coder:1.5b")
    imp.add_argument("file", help="a .gguf file, or a model of Ollama's or LM Studio's store: ollama:MODEL[:TAG], "
                                  "lmstudio:PUBLISHER/REPOSITORY[/FILE] (semantic models list shows them)")
    imp.add_argument("--name", help="model name (default: the file name; ollama:a:b -> ollama-a-b)")
    imp.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                     help="weights dtype (auto: bfloat16 on Apple silicon, float32 elsewhere)")
    imp.add_argument("--quantize", type=int, choices=[4, 8],
                     help="quantize the linear and embedding weights with MLX (affine, as mlx_lm.convert -q)")
    imp.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                     help="quantization group size (default 64)")
    imp.add_argument("--shard-gb", type=float, default=2.0, help="largest weights file, in GiB (default 2)")
    imp.set_defaults(handler=cmd_models_import)
    install = model_commands.add_parser("install", help="pip-install an embedded model's package, then import it",
                                        epilog="example: semantic models install gemma3-270m")
    install.add_argument("name", choices=EMBEDDED, metavar="MODEL",
                         help=f"one of: {', '.join(EMBEDDED)} (`semantic models list` describes them)")
    install.set_defaults(handler=cmd_models_install)
    calibrate = model_commands.add_parser(
        "calibrate", help="measure a model's auto KV format now (a server serves f16 until it is recorded)",
        epilog="example: semantic models calibrate ollama-qwen2.5-coder-1.5b")
    calibrate.add_argument("name", help="an installed model (semantic models list)")
    calibrate.set_defaults(handler=cmd_models_calibrate)
    pull = model_commands.add_parser(
        "pull", help="download an MLX model from the Hugging Face Hub into its cache",
        epilog="example: semantic models pull mlx-community/Qwen2.5-0.5B-Instruct-4bit  (then: semantic serve "
               "--model mlx-community/Qwen2.5-0.5B-Instruct-4bit). HF_ENDPOINT, HF_TOKEN, HF_HUB_CACHE and HF_HOME "
               "apply as they do to huggingface_hub")
    pull.add_argument("repo_id", metavar="ORG/NAME", help="a model id on the Hub")
    pull.set_defaults(handler=cmd_models_pull)
    rm = model_commands.add_parser(
        "rm", help="remove a model (from the Hugging Face cache: --hf-cache)",
        epilog="example: semantic models rm my-model")
    rm.add_argument("name", metavar="NAME", help="a model's name (`semantic models list`), or ORG/NAME")
    rm.add_argument("--hf-cache", action="store_true",
                    help="delete ORG/NAME from the Hugging Face cache, which other tools (mlx_lm) may use too")
    rm.add_argument("--force", action="store_true", help="remove it even though the configuration names it")
    rm.set_defaults(handler=cmd_models_rm)
    model_commands.add_parser("list", help="the models there are, and where each came from").set_defaults(
        handler=cmd_models_list)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the deepest command ``args`` names: ``semantic models`` for
    ``semantic models``, ``semantic models rm`` for ``semantic models rm x``."""
    while True:
        commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, commands.dest, None) if commands is not None else None
        if commands is None or name is None:
            return parser
        parser = commands.choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            code = _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
    except BrokenPipeError:
        # The reader left (`semantic config | head -1`): the rest of the output goes nowhere and
        # the exit status is that of a tool SIGPIPE ended (the Python documentation's way).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    if code == 128 + signal.SIGINT:
        # Interrupted (Ctrl-C), its work stopped and written: leave without the interpreter's
        # teardown, where a C++ destructor of MLX's may meet a thread still running and abort
        # ("terminate called without an active exception", exit -6 instead of 130).
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "handler", None) is cmd_launch and "--" in argv:
        # The client's own arguments: everything after the first --, cut before argparse sees
        # it (argparse drops a -- that follows a positional, and then reads what comes after
        # it as its own: `launch claude -- -p hi` failed so on Python 3.11-3.13).
        cut = argv.index("--")
        args, extra = parser.parse_known_args(argv[:cut])
        args.args = argv[cut + 1:]
    chosen = _chosen(parser, args)
    if extra:  # the usage of the command given, not the top level's
        hint = " (the client's own arguments go after --)" if getattr(args, "handler", None) is cmd_launch else ""
        chosen.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if getattr(args, "handler", None) is None:  # `semantic`, `semantic models`: a command is wanted
        chosen.print_help()
        return 0
    try:
        settings = load_settings(**setting_overrides(args))
        configure_logging(settings.log_level, settings.log_format)
        _keep_private(settings.home)
        return int(args.handler(settings, args))
    except SemanticError as exc:
        print(f"semantic: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "mlx":
            raise
        print(f"semantic: error: {MLX_MISSING}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
