"""The `semantic` command as a user runs it: config, models, jobs, worker."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from app.catalog.embedded import SMOLLM2, locate_gguf
from app.engine.calibration import SHIPPED
from conftest import ROOT
from support.dbcheck import query


def semantic(home: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "SEMANTIC_HOME": str(home), **(env or {})}
    full_env.pop("SEMANTIC_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def test_config_prints_effective_settings(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("threads = 3\nport = 9000\n")
    result = semantic(tmp_path, "config", env={"SEMANTIC_PORT": "9123"})
    assert result.returncode == 0, result.stderr
    assert "port = 9123" in result.stdout and "threads = 3" in result.stdout
    assert str(tmp_path / "config.toml") in result.stdout


def test_config_does_not_print_the_api_key(tmp_path: Path) -> None:
    result = semantic(tmp_path, "config", env={"SEMANTIC_API_KEY": "sk-very-secret"})
    assert result.returncode == 0 and "sk-very-secret" not in result.stdout
    assert 'api_key = "(set, not shown)"' in result.stdout


def test_bad_configuration_is_a_clear_error(tmp_path: Path) -> None:
    result = semantic(tmp_path, "config", env={"SEMANTIC_PORT": "http"})
    assert result.returncode == 2 and "port: expected an integer" in result.stderr


def test_a_network_bind_without_a_key_refuses_to_start(tmp_path: Path) -> None:
    """Before anything is loaded or bound: a clear error naming the ways out."""
    for args, env in ((("serve", "--host", "0.0.0.0", "--port", "1"), None),
                      (("serve", "--port", "1"), {"SEMANTIC_HOST": "::"})):
        result = semantic(tmp_path, *args, env=env, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "api_key is not set" in result.stderr and "--insecure-no-auth" in result.stderr
        assert not (tmp_path / "semantic.db").exists()  # refused before the store was touched


def test_models_import_and_list(tmp_path: Path) -> None:
    gguf = locate_gguf(SMOLLM2, tmp_path)
    result = semantic(tmp_path, "models", "import", str(gguf), "--name", "my-smol")
    assert result.returncode == 0, result.stderr
    assert "imported llama model 'my-smol'" in result.stdout
    model_dir = tmp_path / "models" / "my-smol"
    assert {p.name for p in model_dir.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"}
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"
    # kv_format "auto": the embedded SmolLM2 under another name is the model its shipped record is
    # for (the same weights, tokenizer and template): it takes the record, nothing is measured.
    assert "calibrate the KV format" not in result.stderr
    record = json.loads((model_dir / "kv_calibration.json").read_text())
    assert record == json.loads((SHIPPED / f"{SMOLLM2.name}.json").read_text())
    chosen = record["chosen"]
    assert f"my-smol: KV format {chosen} (auto: top-1 " in result.stdout
    listing = semantic(tmp_path, "models", "list").stdout
    assert f"my-smol\tllama\timported from {gguf.resolve()}\t{model_dir}\t" in listing
    assert listing.splitlines()[0] == "NAME\tARCHITECTURE\tSOURCE\tPATH\tKV FORMAT\tWEIGHTS"
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e6
    assert next(line for line in listing.splitlines() if line.startswith("my-smol\t")).endswith(f"\t{weights:.1f} MB")
    assert "gemma3-270m\tnot imported" in listing
    assert f"\tKV {chosen} (auto: top-1 " in listing and "of FP16)" in listing
    pinned = semantic(tmp_path, "models", "list", env={"SEMANTIC_KV_FORMATS": "my-smol=q8"}).stdout
    assert "\tKV q8 (set: " in pinned
    # Weights of another dtype are another model, no record is for: its KV format is calibrated
    # right away, with a progress bar, and recorded.
    result = semantic(tmp_path, "models", "import", str(gguf), "--name", "smol-bf16", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    assert "calibrate the KV format of smol-bf16" in result.stderr and "prefill prose" in result.stderr
    chosen = json.loads((tmp_path / "models" / "smol-bf16" / "kv_calibration.json").read_text())["chosen"]
    assert f"smol-bf16: KV format {chosen} (auto: top-1 " in result.stdout


def test_models_import_with_dtype_quantization_and_shards(tmp_path: Path) -> None:
    gguf = locate_gguf(SMOLLM2, tmp_path)
    result = semantic(tmp_path, "models", "import", str(gguf), "--name", "smol-q8", "--dtype", "float16",
                      "--quantize", "8", "--shard-gb", "0.05", env={"SEMANTIC_KV_FORMAT": "q8"})  # no calibration
    assert result.returncode == 0, result.stderr
    assert "8-bit + float16, 3 shard(s)" in result.stdout, result.stdout
    assert "import " in result.stderr and "B/s" in result.stderr  # the progress bar, in bytes written
    model_dir = tmp_path / "models" / "smol-q8"
    assert len(list(model_dir.glob("model-0000*-of-00003.safetensors"))) == 3
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["torch_dtype"] == "float16"
    assert not (model_dir / "kv_calibration.json").exists()
    bad = semantic(tmp_path, "models", "import", str(gguf), "--dtype", "int8")
    assert bad.returncode == 2 and "invalid choice: 'int8'" in bad.stderr


def test_models_import_refuses_a_non_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_text("nope")
    result = semantic(tmp_path, "models", "import", str(bogus))
    assert result.returncode == 2 and "not a readable GGUF file" in result.stderr


def test_jobs_run_compact_records_the_run(tmp_path: Path) -> None:
    stale = tmp_path / "blocks" / "ab" / "leftover.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_text("partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    result = semantic(tmp_path, "jobs", "run", "compact")
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert done["removed_temp_files"] == 1 and done["orphan_files"] == 0
    assert done["vacuumed"] is False  # a fresh database has nothing to reclaim
    assert not stale.exists()
    assert query(tmp_path / "semantic.db", "SELECT name, status FROM job_runs") == [("compact", "ok")]


def test_a_failing_or_locked_job_leaves_a_job_runs_row(tmp_path: Path) -> None:
    assert semantic(tmp_path, "jobs", "run", "evict").returncode == 0  # migrates; one ok run
    db = sqlite3.connect(tmp_path / "semantic.db")
    with db:  # an unreferenced old block whose deletion the database refuses: compact fails
        db.execute("INSERT INTO blocks (hash, model_fingerprint, n_tokens, nbytes, ref_count, tier, created_at, "
                   "last_access_at) VALUES ('h', 'f', 256, 1, 0, 'warm', '2020-01-01', '2020-01-01')")
        db.execute("CREATE TRIGGER refuse BEFORE DELETE ON blocks BEGIN SELECT RAISE(ABORT, 'injected'); END")
    db.close()
    failed = semantic(tmp_path, "jobs", "run", "compact")
    assert failed.returncode == 1 and "job compact failed: IntegrityError" in failed.stderr
    locker = ("from worker.huey_app import huey\nfrom worker.tasks import JOBS\n"
              "huey.lock_task('expire').acquire()")  # as a worker running expire holds it
    subprocess.run([sys.executable, "-c", locker], cwd=ROOT, check=True,
                   env={**os.environ, "SEMANTIC_HOME": str(tmp_path)})
    skipped = semantic(tmp_path, "jobs", "run", "expire")
    assert skipped.returncode == 0 and "skipped" in skipped.stdout
    rows = query(tmp_path / "semantic.db", "SELECT name, status, result FROM job_runs ORDER BY id")
    assert [(name, status) for name, status, _ in rows] == [("evict", "ok"), ("compact", "error"),
                                                           ("expire", "skipped")]
    assert "injected" in rows[1][2]


def wait_for(check, timeout_s: float = 60) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


def test_the_worker_migrates_and_its_consumer_runs_queued_jobs(tmp_path: Path) -> None:
    env = {**os.environ, "SEMANTIC_HOME": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "app", "worker"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    db = tmp_path / "semantic.db"
    try:
        assert wait_for(lambda: db.exists() and ("requests",) in query(
            db, "SELECT name FROM sqlite_master WHERE type = 'table'"))
        assert process.poll() is None
        # Calling a Huey task enqueues it in huey.db; the running consumer executes it.
        subprocess.run([sys.executable, "-c", "from worker.tasks import JOBS\nfor job in JOBS.values(): job()"],
                       cwd=ROOT, env=env, check=True, timeout=60)
        # (A periodic run may land too when the test crosses a scheduled minute.)
        names = lambda: {name for (name,) in query(db, "SELECT name FROM job_runs")}  # noqa: E731
        assert wait_for(lambda: names() == {"compact", "evict", "expire", "prune", "tier_gc"}), process.stdout
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_periodic_schedules() -> None:
    from datetime import datetime

    from worker.tasks import compact, evict, expire

    def minutes(task) -> list[int]:  # type: ignore[no-untyped-def]
        check = task.task_class().validate_datetime
        return [m for m in range(60) if check(datetime(2026, 1, 1, 3, m))]

    assert minutes(expire) == list(range(0, 60, 10))
    assert minutes(evict) == list(range(5, 60, 10))
    assert minutes(compact) == [17]


def test_sql_prints_a_table_and_refuses_writes(tmp_path: Path) -> None:
    assert semantic(tmp_path, "jobs", "run", "compact").returncode == 0  # creates the database
    result = semantic(tmp_path, "sql", "SELECT name, status FROM job_runs")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split() == ["name", "status"] and "compact  ok" in result.stdout
    refused = semantic(tmp_path, "sql", "DELETE FROM job_runs")
    assert refused.returncode == 2 and "refused" in refused.stderr
    assert "(1 row)" in semantic(tmp_path, "sql", "SELECT * FROM job_runs").stdout


def test_an_import_name_that_leaves_the_models_directory_is_refused(tmp_path: Path) -> None:
    """`--name ..` once resolved to the home itself, and a successful import replaced it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "keep.txt").write_text("mine")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    for name in ("..", "../elsewhere", "/tmp/x", ".hidden", "a/b"):
        result = semantic(home, "models", "import", str(fake), "--name", name)
        assert result.returncode == 2 and "use letters, digits and ._-" in result.stderr, (name, result.stderr)
    assert (home / "keep.txt").read_text() == "mine" and not (tmp_path / "elsewhere").exists()


def test_the_home_and_the_history_are_private_to_their_user(tmp_path: Path) -> None:
    """Created by the CLI: the home 0700, the database 0600; one an earlier version left
    open (0755 / 0644) is closed at the next start."""
    fresh = tmp_path / "fresh"
    assert semantic(fresh, "jobs", "run", "expire").returncode == 0
    assert (fresh.stat().st_mode & 0o777, (fresh / "semantic.db").stat().st_mode & 0o777) == (0o700, 0o600)
    open_home = tmp_path / "open"
    assert semantic(open_home, "jobs", "run", "expire").returncode == 0
    open_home.chmod(0o755)
    (open_home / "semantic.db").chmod(0o644)
    assert semantic(open_home, "config").returncode == 0
    assert (open_home.stat().st_mode & 0o777, (open_home / "semantic.db").stat().st_mode & 0o777) == (0o700, 0o600)


def test_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    for flag in ("--version", "-V"):
        result = semantic(tmp_path, flag)
        assert (result.returncode, result.stdout) == (0, f"semantic {version('semantic')}\n"), result.stderr


def test_a_closed_pipe_ends_the_output_quietly(tmp_path: Path) -> None:
    """`semantic config | head -1`: no BrokenPipeError traceback; the exit status of a tool SIGPIPE ended."""
    for args, code in ((("config",), 141), (("jobs", "run", "expire"), 141), (("--help",), 0)):  # argparse: 0
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
        try:
            result = subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, stdout=write_end,
                                    stderr=subprocess.PIPE, text=True, timeout=120,
                                    env={**os.environ, "SEMANTIC_HOME": str(tmp_path)})
        finally:
            os.close(write_end)
        assert result.returncode == code and "Broken" not in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, (args, result.stderr)


def test_help_lists_every_command_and_choice(tmp_path: Path) -> None:
    from app.catalog.embedded import EMBEDDED
    from app.cli import JOBS, SQL_TABLES, SQL_VIEWS, build_parser
    from worker.tasks import JOBS as WORKER_JOBS

    commands = [a for a in build_parser()._actions if a.dest == "command"][0].choices
    top = semantic(tmp_path, "--help", env={"COLUMNS": "80"})
    assert top.returncode == 0 and "--version" in top.stdout and "SEMANTIC_" in top.stdout
    section = top.stdout.split("commands:\n  COMMAND\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in section] == list(commands)  # one line each: no wrapped help
    assert all(len(line.split()) >= 3 for line in section)
    assert set(commands) == {"serve", "worker", "jobs", "sql", "config", "status", "chat", "launch", "pool", "models",
                             "agents"}
    assert JOBS == tuple(WORKER_JOBS)
    jobs = semantic(tmp_path, "jobs", "run", "--help").stdout
    assert all(job in jobs for job in JOBS) and "example: semantic jobs run" in jobs
    bogus = semantic(tmp_path, "jobs", "run", "bogus")
    assert bogus.returncode == 2 and "invalid choice: 'bogus'" in bogus.stderr and "'prune'" in bogus.stderr
    install = semantic(tmp_path, "models", "install", "--help").stdout
    assert all(name in install for name in EMBEDDED)
    assert "invalid choice: 'llama'" in semantic(tmp_path, "models", "install", "llama").stderr
    # `sql --help` names every table and view there is to read (the schema a migration makes).
    assert semantic(tmp_path, "jobs", "run", "expire").returncode == 0
    schema = {name for (name,) in query(tmp_path / "semantic.db",
                                        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
    assert {*SQL_TABLES, *SQL_VIEWS} == schema - {"alembic_version"}
    sql = " ".join(semantic(tmp_path, "sql", "--help").stdout.split())
    assert all(name in sql for name in schema - {"alembic_version"}) and "example: semantic sql" in sql


def test_alembic_is_quiet_unless_debugging_and_json_logs(tmp_path: Path) -> None:
    """Migrating a new database logs nothing at INFO; at DEBUG Alembic's steps show, and
    with log_format json every line is one JSON object."""
    quiet = semantic(tmp_path / "info", "jobs", "run", "expire")
    assert quiet.returncode == 0 and "alembic" not in quiet.stderr.lower(), quiet.stderr
    loud = semantic(tmp_path / "debug", "jobs", "run", "expire",
                    env={"SEMANTIC_LOG_LEVEL": "DEBUG", "SEMANTIC_LOG_FORMAT": "json"})
    assert loud.returncode == 0, loud.stderr
    records = [json.loads(line) for line in loud.stderr.splitlines()]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any(r["logger"].startswith("alembic") and "Running upgrade" in r["message"] for r in records)
    bad = semantic(tmp_path, "config", env={"SEMANTIC_LOG_FORMAT": "xml"})
    assert bad.returncode == 2 and "log_format: 'xml' is not text or json" in bad.stderr


def test_without_mlx_serve_names_the_extra_to_install(tmp_path: Path) -> None:
    """As after a plain `pip install .` on Linux: `import mlx` fails (here: blocked)."""
    for args in (("serve", "--no-worker", "--port", "1"), ("models", "list")):
        code = f"import sys\nsys.modules['mlx'] = None\nfrom app.cli import main\nsys.exit(main({list(args)!r}))"
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "SEMANTIC_HOME": str(tmp_path)})
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr)
        assert done.stderr.splitlines()[-1] == (
            "semantic: error: MLX is not installed; install Semantic with the extra for this machine: "
            "pip install 'semantic[cpu]' (no GPU) or 'semantic[cuda]' (NVIDIA GPU)"), done.stderr


def test_serve_help_names_every_setting_with_its_flag_and_variable(tmp_path: Path) -> None:
    from app.settings import Settings

    result = semantic(tmp_path, "serve", "--help", env={"COLUMNS": "100"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in Settings.model_fields:
        flag, variable = "--" + name.replace("_", "-"), f"SEMANTIC_{name.upper()}"
        [start] = [i for i, line in enumerate(lines) if line.lstrip().startswith(flag + " ") or
                   line.lstrip() == flag or line.lstrip().startswith(flag + ",")]
        entry = " ".join(lines[start:start + 8])  # the flag's help, wrapped
        assert variable in entry.split(flag, 1)[1].split("  --", 1)[0], (flag, entry)
    assert "--no-worker" in result.stdout and "example: semantic serve --port 8080" in result.stdout


def test_no_command_prints_a_password(tmp_path: Path) -> None:
    """``semantic config`` masks the password of every URL setting (``database_url``, and the
    credentials of ``block_store``'s endpoint), not only ``api_key``; a malformed URL's error
    and the log mask it too (before: printed whole)."""
    secret = "hunter2-pw"
    result = semantic(tmp_path, "config", env={
        "SEMANTIC_DATABASE_URL": f"postgresql://sem:{secret}@127.0.0.1:1/semantic?password={secret}",
        "SEMANTIC_BLOCK_STORE": f"s3://blocks/pool?endpoint=http://AKIA:{secret}@127.0.0.1:1"})
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    assert 'database_url = "postgresql://sem:***@127.0.0.1:1/semantic?password=***"' in result.stdout
    for url in (f"mysql://sem:{secret}@db/semantic", f"postgres:sem:{secret}@db/semantic"):
        malformed = semantic(tmp_path, "jobs", "run", "expire", env={"SEMANTIC_DATABASE_URL": url})
        assert malformed.returncode != 0 and "database_url" in malformed.stderr, malformed.stderr
        assert secret not in malformed.stdout + malformed.stderr, malformed.stderr


def test_a_bare_command_prints_its_help_and_a_bad_flag_its_own_usage(tmp_path: Path) -> None:
    bare = semantic(tmp_path, timeout=60)
    assert bare.returncode == 0 and bare.stdout.startswith("usage: semantic") and "serve" in bare.stdout, bare.stderr
    models = semantic(tmp_path, "models", timeout=60)
    assert models.returncode == 0 and models.stdout.startswith("usage: semantic models") and "pull" in models.stdout
    typo = semantic(tmp_path, "serve", "--prot", "9000", timeout=60)
    assert typo.returncode == 2 and typo.stderr.startswith("usage: semantic serve"), typo.stderr
    assert "unrecognized arguments: --prot 9000" in typo.stderr


def test_a_model_given_by_a_path_that_is_not_a_model_says_so(tmp_path: Path) -> None:
    missing = semantic(tmp_path, "serve", "--no-worker", "--model", "./no-such-dir", timeout=60)
    assert missing.returncode == 2 and "no such directory" in missing.stderr, missing.stderr
    (tmp_path / "empty").mkdir()
    empty = semantic(tmp_path, "serve", "--no-worker", "--model", str(tmp_path / "empty"), timeout=60)
    assert empty.returncode == 2 and "is not a model directory (no config.json)" in empty.stderr, empty.stderr
