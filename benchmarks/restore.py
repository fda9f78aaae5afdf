"""The restart path against its floor: a conversation's cache read back from disk.

    .venv/bin/python -m benchmarks.restore [--shape llama3.2-1b] [--layers N] [--tokens 16384] [--format q8]

A conversation of ``--tokens`` tokens of a named model shape (benchmarks/synthetic.py's
shapes: only the KV shape matters, so no weights are made) is stored by the cache manager
as a turn stores it, then restored by a fresh manager, as after a restart: its files read,
each block made into MLX arrays by the thread that read it, its float working copy built
while other threads check the blocks' checksums (``CacheManager.lease``; ``read+verify`` is
the read with the checks on the reading threads, as ``CacheFiles.read_conversation`` does).
The floor is what no restore can avoid: reading the same files' bytes (one thread, then
side by side) and dequantizing the same blocks already in memory into the working copy.
Beside them, one part of the restore on its own: the read blocks (NumPy) made into MLX
arrays on the model's device (``into arrays``; on an H200 the restore took twice its read
and verify, and this part was not measured apart), and the same made as one MLX array a
file with a view of it for each array (``by file``: one copy a file, not one an array).
And a probe of fewer, larger arrays (``stacked``: each read block made into one MLX array a
name, its layers stacked as the file holds them, the blocks joined a name at a time and the
working copy dequantized from each layer's view of the joined arrays: 6 arrays a block and 6
joins, where the restore makes and joins 6 a block and layer, 24,576 for 32K tokens of a
32-layer model; on the 2-core CPU it takes what they take, 0.22-0.27 s against 0.23-0.26 s at
16K tokens, and on a GPU, where each array is an allocation and each join a kernel, it says
whether the blocks should be kept so). And a probe of overlapping the reads with the
dequantizing (``overlapped``: each group of 16 blocks dequantized as soon as its files are
read, on its own; without the tail and the join into one working copy, so a bound on what a
pipelined restore could reach: on the 2-core CPU that join, a float copy of the whole working
copy, costs more than the overlap gains).
And the read blocks made into MLX arrays and their working copy built from them, new arrays
every run (``fresh copy``: the floor's dequantizing reads arrays it made once; on mlx-cuda
``mx.array`` of host memory is managed memory, whose pages the first kernels to read them
migrate to the GPU, and only a fresh array pays that), against the same with each block
file's bytes brought in by ``mx.load`` (``loaded copy``: mlx-cuda copies what it loads into
device memory, as mlx-lm's weights come in; each layer a view of the block's arrays, which
on the CPU costs what the ``stacked`` probe's views cost).
And the first restore in a fresh process (``first restore s``), what the first turn after a
restart waits for: the others are the best of ``--runs`` in one process, whose freed buffers
serve the next run; a fresh process faults in all of its memory (on this VM, memory the guest
has not touched lately costs far more again: while this process holds its own, the child's
is such). KV values are random: the time does not depend on them. The files are in the page
cache: this measures the code, not the disk.

Prints a table, writes benchmarks/results/restore[-NAME].json and .png, naming the device
and the commit.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.blas import load_fast_blas  # noqa: E402

load_fast_blas("")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from app import huge_pages  # noqa: E402
from app.cache.blocks import (BLOCK_TOKENS, KVBlock, capacity, dequantize_layer, to_working_cache,  # noqa: E402
                              working_streams)
from app.cache.files import READ_THREADS, read  # noqa: E402
from app.cache.formats import KV_FORMATS  # noqa: E402
from app.cache.manager import CacheManager  # noqa: E402
from app.cache.records import CacheRecord  # noqa: E402
from app.store.db import make_engine, make_session_factory, upgrade  # noqa: E402
from app.clock import utcnow  # noqa: E402
from app.store.history import ensure_conversation, touch_agent  # noqa: E402
from app.types import Prompt  # noqa: E402
from benchmarks.common import device, print_table, pyplot, save_plot, write_results  # noqa: E402
from benchmarks.synthetic import SHAPES, shape_config  # noqa: E402

FINGERPRINT = "b" * 64
OVERLAP_BLOCKS = 16  # blocks dequantized at once in the overlapped probe


def _prompt(n_tokens: int) -> Prompt:
    tokens = tuple(i % 30000 + 100 for i in range(n_tokens))
    return Prompt("".join(chr(0x4E00 + t % 20000) for t in tokens), tokens, tuple(range(1, n_tokens + 1)))


def _manager(home: Path, n_layers: int, kv_format: Any, dtype: mx.Dtype) -> CacheManager:
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions.begin() as session:
        touch_agent(session, "agent", "direct", utcnow())
        ensure_conversation(session, "conversation", "agent", "direct", utcnow())  # as the API does before a turn
    return CacheManager(fingerprint=FINGERPRINT, n_layers=n_layers, dtype=dtype, blocks_dir=home / "blocks",
                        sessions=sessions, budget_bytes=1 << 40, kv_format=kv_format, working_copies=0)


def _store(home: Path, config: dict[str, Any], n_tokens: int, kv_format: Any, dtype: mx.Dtype) -> None:
    """One turn's commit of a conversation of ``n_tokens`` random KV, written to disk."""
    n_layers = config["num_hidden_layers"]
    heads, head_dim = config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // \
        config["num_attention_heads"]
    caches = _manager(home, n_layers, kv_format, dtype)
    prompt = _prompt(n_tokens)
    lease = caches.lease("agent", "conversation", prompt)
    mx.random.seed(0)
    for layer in lease.cache:
        keys = mx.random.normal((1, heads, n_tokens, head_dim)).astype(dtype)
        values = mx.random.normal((1, heads, n_tokens, head_dim)).astype(dtype)
        layer.update_and_fetch(keys, values)
    caches.commit(lease, CacheRecord(prompt.token_ids, prompt.text, prompt.ends), lease.cache)
    assert caches.flush(600)
    caches.close()


def _best(runs: int, step: Callable[[Any], Any], setup: Callable[[], Any] = lambda: None) -> float:
    """The fastest of ``runs`` calls of ``step`` (each given what an untimed ``setup`` made)."""
    times = []
    for _ in range(runs):
        made = setup()
        start = time.perf_counter()
        step(made)
        times.append(time.perf_counter() - start)
    return min(times)


def _one_copy(arrays: dict[str, Any]) -> tuple[mx.array, list[mx.array]]:
    """A file's arrays (NumPy views of the one buffer it was read into) as one MLX array of
    that buffer and a view of it for each: one host-to-device copy a file instead of one an
    array (what ``KVBlock.from_numpy`` makes: 96-192 a block). A probe of whether the
    per-array copies are what the H200's restore spends its unexplained time on."""
    base = next(iter(arrays.values()))
    while isinstance(base, np.ndarray):
        base = base.base
    buffer = np.frombuffer(base.obj if isinstance(base, memoryview) else base, dtype=np.uint8)
    whole = mx.array(buffer)
    views = []
    for array in arrays.values():
        start = array.ctypes.data - buffer.ctypes.data
        views.append(whole[start:start + array.nbytes].view(getattr(mx, array.dtype.name)).reshape(array.shape))
    return whole, views


def _loaded_block(raw: bytes, names: tuple[str, ...], n_layers: int) -> KVBlock:
    """A block file's bytes (one array a name, the layers stacked) by ``mx.load``, each layer a
    view of its arrays. mlx-cuda copies what it loads into device memory (``Load::eval_gpu``: a
    host buffer, then ``cudaMemcpyAsync``), where ``mx.array`` of a NumPy array is managed memory
    (``cudaMallocManaged``) whose pages the first kernels to read them migrate to the GPU."""
    arrays = mx.load(io.BytesIO(raw), format="safetensors")  # BytesIO shares the bytes: no copy
    assert isinstance(arrays, dict)
    return KVBlock(BLOCK_TOKENS, tuple(tuple(arrays[name][i] for name in names) for i in range(n_layers)))


def _as_mlx(n_layers: int) -> Callable[[dict[str, np.ndarray]], KVBlock]:
    """A block file's arrays into MLX arrays, as the cache manager makes them as it reads."""
    return lambda arrays: KVBlock.from_numpy(arrays, n_layers, BLOCK_TOKENS)


def _files(home: Path) -> list[Path]:
    return sorted(p for p in (home / "blocks").rglob("*.safetensors"))


def _setup(shape: str, layers: int | None, format_name: str) -> tuple[dict[str, Any], int, mx.Dtype, Any]:
    """The shape's config, its layer count, the working dtype and the KV format."""
    config = shape_config(shape, layers)
    dtype = mx.bfloat16 if mx.default_device().type == mx.gpu else mx.float32
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config, config["num_hidden_layers"], dtype, KV_FORMATS[format_name].for_head_dim(head_dim)


def _restore(caches: CacheManager, n_tokens: int) -> None:
    """The stored conversation of ``n_tokens`` tokens leased whole, its working copy built."""
    lease = caches.lease("agent", "conversation", _prompt(n_tokens + 1))
    assert lease.n_reused == n_tokens, lease.n_reused
    mx.eval([layer.keys for layer in lease.cache])
    caches.close()


def first_restore(home: Path, shape: str, layers: int | None, n_tokens: int, format_name: str) -> float:
    """Seconds of the first restore in this process (run in a fresh one)."""
    _, n_layers, dtype, kv_format = _setup(shape, layers, format_name)
    caches = _manager(home, n_layers, kv_format, dtype)
    return _best(1, lambda made: _restore(made, n_tokens), lambda: caches)


def _first_restore_in_a_fresh_process(home: Path, shape: str, layers: int | None, n_tokens: int,
                                      format_name: str) -> float:
    command = [sys.executable, "-m", "benchmarks.restore", "--first-restore", str(home), "--shape", shape,
               "--tokens", str(n_tokens), "--format", format_name, *(["--layers", str(layers)] if layers else [])]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          check=True, timeout=600)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["first_restore_s"])


def measure(shape: str, layers: int | None, n_tokens: int, format_name: str, runs: int) -> dict[str, Any]:
    config, n_layers, dtype, kv_format = _setup(shape, layers, format_name)
    with tempfile.TemporaryDirectory(prefix="restore-") as scratch:
        home = Path(scratch)
        started = time.perf_counter()
        _store(home, config, n_tokens, kv_format, dtype)
        print(f"stored {n_tokens} tokens of {shape} ({n_layers} layers) in {format_name}: "
              f"{time.perf_counter() - started:.1f} s")
        files = _files(home)
        nbytes = sum(p.stat().st_size for p in files)

        def fresh() -> CacheManager:  # as after a restart: nothing in memory
            return _manager(home, n_layers, kv_format, dtype)

        def restore(caches: CacheManager) -> None:
            _restore(caches, n_tokens)

        def read_files(caches: CacheManager) -> None:
            caches._files.read_conversation(caches._index.load("conversation"), _as_mlx(n_layers))  # noqa: SLF001
            caches.close()

        def read_serial(_: None) -> None:
            for path in files:
                path.read_bytes()

        def read_parallel(_: None) -> None:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(Path.read_bytes, files))

        def overlapped(caches: CacheManager) -> None:
            """The full blocks read, verified and dequantized with the reads and the dequantizing
            side by side: each group of ``OVERLAP_BLOCKS`` into a working copy of its own as soon
            as its files are read (no tail, no join into one: what overlapping could gain)."""
            rows = caches._index.load("conversation").blocks  # noqa: SLF001
            with ThreadPoolExecutor(READ_THREADS) as pool:
                reads = [pool.submit(caches._files.read_block, row.hash, row.path, row.checksum,  # noqa: SLF001
                                     _as_mlx(n_layers)) for row in rows]
                for start in range(0, len(rows), OVERLAP_BLOCKS):
                    group = [read.result() for read in reads[start:start + OVERLAP_BLOCKS]]
                    part = to_working_cache(group, n_layers, len(group) * 256, dtype, kv_format)
                    mx.eval([layer.keys for layer in part])
            caches.close()

        caches = _manager(home, n_layers, kv_format, dtype)
        entry = caches._index.load("conversation")  # noqa: SLF001
        stored = caches._files.read_conversation(entry, _as_mlx(n_layers))  # noqa: SLF001
        # Each block file's arrays as read, views of a buffer of its own (read_conversation's
        # are views of a buffer each reading thread reuses: made into MLX arrays at once).
        block_paths = [caches._files.local(row.path) for row in entry.blocks]  # noqa: SLF001
        read_blocks = [read(path)[0] for path in block_paths]
        caches.close()

        def to_arrays(_: None) -> list[KVBlock]:  # the read blocks (NumPy) into MLX arrays, on the model's device
            made = [KVBlock.from_numpy(arrays, n_layers, 256) for arrays in read_blocks]
            made += [KVBlock.from_numpy(stored.tail, n_layers, stored.tail_tokens)] if stored.tail is not None else []
            mx.eval([a for block in made for layer in block.layers for a in layer])
            return made

        blocks = to_arrays(None)

        whole, views = _one_copy(read_blocks[0])  # the views hold what the arrays do
        assert all(mx.array_equal(v, mx.array(a)) for v, a in zip(views, read_blocks[0].values()))

        def to_arrays_by_file(_: None) -> None:  # the same, one MLX array a file, each array a view of it
            made = []
            for arrays in read_blocks + ([stored.tail] if stored.tail is not None else []):
                whole, views = _one_copy(arrays)
                made += [whole, *views]
            mx.eval(made)

        names = blocks[0].names
        numpy_blocks = read_blocks + ([stored.tail] if stored.tail is not None else [])
        stacked_files = len(numpy_blocks[0]) == len(names)  # one array a name, the layers stacked

        def stacked(_: None) -> None:  # one array a name and block, joined a name at a time
            whole = [[mx.array(arrays[name]) for name in names] for arrays in numpy_blocks]
            room = capacity(n_tokens) - n_tokens
            streams = working_streams()
            joined = []
            for j in range(len(names)):
                parts = [block[j] for block in whole]
                parts.append(mx.zeros((*parts[-1].shape[:3], room, parts[-1].shape[4]), dtype=parts[-1].dtype))
                with mx.stream(streams[j % len(streams)]):
                    joined.append(mx.concatenate(parts, axis=3))
            copies = []
            for i in range(n_layers):
                with mx.stream(streams[i % len(streams)]):
                    copies.extend(dequantize_layer(tuple(array[i] for array in joined), kv_format, dtype))
            mx.eval(copies)

        def working_copy(made: list[KVBlock]) -> list[KVCache]:  # evaluated, as to_working_cache leaves it
            return to_working_cache(made, n_layers, n_tokens, dtype, kv_format)

        def dequantize(_: None) -> None:
            working_copy(blocks)

        tail = [KVBlock.from_numpy(stored.tail, n_layers, stored.tail_tokens)] if stored.tail is not None else []

        def fresh_working_copy(_: None) -> None:  # into arrays and dequantized, new arrays every run
            working_copy([KVBlock.from_numpy(arrays, n_layers, BLOCK_TOKENS) for arrays in read_blocks] + tail)

        file_bytes = [path.read_bytes() for path in block_paths]  # as verified above
        if stacked_files:  # the loaded arrays hold what the read ones do
            loaded = _loaded_block(file_bytes[0], names, n_layers)
            assert all(mx.array_equal(a, b) for mine, theirs in zip(loaded.layers, blocks[0].layers)
                       for a, b in zip(mine, theirs))

        def loaded_working_copy(_: None) -> None:  # the same bytes brought in by mx.load, then dequantized
            working_copy([_loaded_block(raw, names, n_layers) for raw in file_bytes] + tail)

        first = _first_restore_in_a_fresh_process(home, shape, layers, n_tokens, format_name)
        restore(fresh())  # warm: page cache, kernels
        figures = {
            "first_restore_s": first,
            "restore_s": _best(runs, restore, fresh),
            "read_and_verify_s": _best(runs, read_files, fresh),
            "overlapped_s": _best(runs, overlapped, fresh),
            "floor_read_serial_s": _best(runs, read_serial),
            "floor_read_parallel_s": _best(runs, read_parallel),
            "floor_dequantize_s": _best(runs, dequantize),
            "to_arrays_s": _best(runs, to_arrays),
            "to_arrays_by_file_s": _best(runs, to_arrays_by_file),
            "stacked_s": _best(runs, stacked) if stacked_files else None,
            "fresh_working_copy_s": _best(runs, fresh_working_copy),
            "loaded_working_copy_s": _best(runs, loaded_working_copy) if stacked_files else None,
        }
    floor = min(figures["floor_read_serial_s"], figures["floor_read_parallel_s"]) + figures["floor_dequantize_s"]
    return {"shape": shape, "layers": n_layers, "tokens": n_tokens, "format": kv_format.name,
            "files": len(files), "bytes": nbytes, **figures, "floor_s": floor,
            "restore_vs_floor": figures["restore_s"] / floor, "gb_per_s": nbytes / figures["restore_s"] / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--format", default="q8", choices=sorted(KV_FORMATS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--name", default="", help="results file suffix (restore-NAME.json)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--first-restore", type=Path, default=None, help=argparse.SUPPRESS)  # a fresh process's part
    args = parser.parse_args()
    huge_pages.start_with_huge_pages()  # as `semantic serve` does: the working copy is fresh memory
    if args.first_restore is not None:
        took = first_restore(args.first_restore, args.shape, args.layers, args.tokens[0], args.format)
        print(json.dumps({"first_restore_s": took}))
        return
    where = {**device(), "memory": huge_pages.describe(os.environ, huge_pages.thp_mode())}
    print(f"device: {where['mlx_device']} ({where['name']}); {where['memory']}")
    rows = [measure(args.shape, args.layers, n, args.format, args.runs) for n in args.tokens]
    print_table(["tokens", "MB", "first restore s", "restore s", "read+verify s", "into arrays s", "by file s",
                 "floor read s", "floor dequantize s", "stacked s", "overlapped s", "fresh copy s", "loaded copy s",
                 "floor s", "restore / floor", "GB/s"],
                [[r["tokens"], round(r["bytes"] / 1e6, 1), r["first_restore_s"], r["restore_s"], r["read_and_verify_s"],
                  r["to_arrays_s"], r["to_arrays_by_file_s"],
                  min(r["floor_read_serial_s"], r["floor_read_parallel_s"]), r["floor_dequantize_s"],
                  r["stacked_s"], r["overlapped_s"], r["fresh_working_copy_s"], r["loaded_working_copy_s"],
                  r["floor_s"],
                  r["restore_vs_floor"], r["gb_per_s"]] for r in rows])
    name = "restore" + (f"-{args.name}" if args.name else "")
    extra = {"directory": args.out} if args.out else {}
    path = write_results(name, {"device": where, "runs": rows}, **extra)
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['tokens']} tokens" for r in rows]
        ax.barh([f"{label}: floor" for label in labels], [r["floor_s"] for r in rows], color="#999")
        ax.barh([f"{label}: restore" for label in labels], [r["restore_s"] for r in rows], color="#2a6")
        ax.barh([f"{label}: first restore" for label in labels], [r["first_restore_s"] for r in rows], color="#a62")
        ax.set_xlabel("seconds")
        ax.set_title(f"restore vs floor, {args.shape} {args.format}, {where['name'][:40]}")
        save_plot(fig, name, **extra)


if __name__ == "__main__":
    main()
