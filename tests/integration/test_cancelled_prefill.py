"""What a cancelled prefill keeps is what a finished one stores (issue 58): on the real
SmolLM2, a prefill cancelled part way commits blocks whose checksums equal those of the same
prompt's blocks prefilled to its end in another home (bit-identical KV), and the retry reads
them and answers as the cold prefill does."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest

import app.engine.runner as runner_module
from app.engine.scheduler import PrefillPolicy
from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams
from support.dbcheck import query
from support.engines import conv, flush_caches, make_engine_at, turn

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
MESSAGES = [ChatMessage("user", "The archive lists every shipment by port, weight and date. " * 150
                        + "Which port appears first?")]


def test_a_cancelled_prefill_keeps_the_blocks_a_finished_one_stores(smollm2_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of the full step in both homes, whatever the machine's speed: the same arithmetic
    # on the same chunks, so the comparison sees only what the cancel kept.
    monkeypatch.setattr(runner_module, "PrefillPolicy", partial(PrefillPolicy, alone_budget_s=1e9))
    cancelled = make_engine_at(tmp_path / "cancelled", smollm2_dir, ["a"])
    try:
        job = cancelled.submit(GenerationRequest("req-cancelled", cancelled.render(MESSAGES), GREEDY, "a", conv("a")))
        deadline = time.monotonic() + 120
        while (job.progress is None or job.progress[0] < 1024) and time.monotonic() < deadline:
            time.sleep(0.01)
        job.cancel()
        final = list(job.events())[-1]
        assert isinstance(final, Finished) and final.stop_reason == "cancelled"
        assert final.n_prompt_tokens > 1500  # cancelled part way through a ~1,800-token prompt
        assert flush_caches(cancelled)
        kept = query(tmp_path / "cancelled" / "semantic.db", "SELECT hash, checksum FROM blocks")
        assert len(kept) >= 4, kept  # at least the 1,024 tokens computed, in blocks of 256

        finished = make_engine_at(tmp_path / "finished", smollm2_dir, ["b"])
        try:
            cold_text, cold = turn(finished, "b", MESSAGES, GREEDY)
            assert flush_caches(finished)
        finally:
            finished.stop()
        stored = dict(query(tmp_path / "finished" / "semantic.db", "SELECT hash, checksum FROM blocks"))
        assert cold.n_cached_tokens == 0
        for block, checksum in kept:  # the same tokens' blocks, the same bytes
            assert stored.get(block) == checksum, block

        retry_text, retry = turn(cancelled, "a", MESSAGES, GREEDY)
        assert retry.n_cached_tokens >= 256 * len(kept)
        assert retry_text == cold_text  # the answer a cold prefill gives
    finally:
        cancelled.stop()
