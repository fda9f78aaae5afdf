"""Speculative decoding on the real SmolLM2 changes the speed, never the answer.

Greedy output with prompt-lookup drafts equals greedy output without them, token for
token and text for text, on replies that copy the context (a file re-emitted with one
change, a tool call quoting paths) and on prose, alone and in a batch beside requests
that do not speculate; a turn that ends inside a verified draft (max_tokens, a stop
sequence) ends at the same token, and its committed record is the same. At the level
of ``DecodeBatch``, the cache handed back holds exactly the prompt and the tokens used:
never a rejected draft token, never one after the end; so does a sequence that samples
(exact speculative sampling, whose distribution ``tests/integration/test_sampled_drafts.py``
checks), whose cache equals a fresh prefill of its prompt and the tokens it was handed.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache
from mlx_lm.sample_utils import greedy_sampler, make_sampler

from app.catalog.registry import Catalog
from app.engine.batch import DecodeBatch, prefill
from app.engine.engine import CacheConfig, Engine
from app.engine.model import load_model
from app.engine.sampled_drafts import token_distribution
from app.engine.speculation import Lanes, can_trim_exactly
from app.store.db import make_engine, make_session_factory, upgrade
from app.types import ChatMessage, Finished, GenerationRequest, SamplingParams, TextDelta
from support.engines import cache_manager, wait_idle

FILE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def scale(values, factor):
    """Multiply every value by factor."""
    return [v * factor for v in values]
'''
PROMPTS = {
    "copy": [ChatMessage("user", "Here is utils.py:\n```python\n" + FILE + "```\n"
                         "Repeat the whole file exactly, but rename the function add to plus.")],
    "tool": [ChatMessage("system", "Tools: read_file(path). Answer with one JSON tool call."),
             ChatMessage("user", "The project has src/app/models/user.py, src/app/models/order.py and "
                         "tests/test_order.py. Call read_file on src/app/models/order.py, as JSON: "
                         '{"name": "read_file", "arguments": {"path": "src/app/models/order.py"}}')],
    "prose": [ChatMessage("user", "Write a short story about a lighthouse keeper who finds a message in a bottle.")],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
# Ends that fall inside verified drafts of the copy reply: a token budget, and a stop string
# in the copied code.
ENDINGS = {"max_tokens": dataclasses.replace(GREEDY, max_tokens=37),
           "stop": dataclasses.replace(GREEDY, stop_sequences=("a + b",))}


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    home = tmp_path_factory.mktemp("speculation-home")
    url = f"sqlite:///{home / 'semantic.db'}"
    upgrade(url)
    cache = CacheConfig(home / "blocks", make_session_factory(make_engine(url)), 1 << 30)
    running = Engine(Catalog.single("smollm2", smollm2_dir), cache, max_queue=8, max_batch=8,
                     speculative_tokens=8)
    running.start()
    yield running
    running.stop()


def run(engine: Engine, name: str, conversation: str, sampling: SamplingParams) -> tuple[str, Finished]:
    job = engine.submit(GenerationRequest(f"req-{conversation}", engine.render(PROMPTS[name]), sampling,
                                          f"agent-{conversation}", conversation))
    events = list(job.events())
    assert wait_idle(engine)  # the reply ends before its cache is committed
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1]


def assert_same_turn(engine: Engine, plain: tuple[str, Finished], drafted: tuple[str, Finished],
                     conversations: tuple[str, str]) -> None:
    assert plain[1].n_cached_tokens == drafted[1].n_cached_tokens == 0  # both cold: same prefill
    assert drafted[1].output_token_ids == plain[1].output_token_ids
    assert drafted[0] == plain[0]
    assert (drafted[1].stop_reason, drafted[1].stop_sequence) == (plain[1].stop_reason, plain[1].stop_sequence)
    records = [cache_manager(engine).record(c) for c in conversations]
    assert records[0] is not None and records[0] == records[1]  # tokens, text and ends
    assert records[1].n_tokens == drafted[1].n_prompt_tokens + drafted[1].n_output_tokens


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_output_is_the_same_with_drafts(engine: Engine, name: str) -> None:
    plain = run(engine, name, f"plain-{name}", dataclasses.replace(GREEDY, speculate=False))
    drafted = run(engine, name, f"drafted-{name}", GREEDY)
    assert_same_turn(engine, plain, drafted, (f"plain-{name}", f"drafted-{name}"))
    assert plain[1].n_draft_tokens == 0
    if name != "prose":  # copying replies do speculate (else this test would prove nothing)
        assert drafted[1].n_draft_accepted >= 10, drafted[1]


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_turn_ending_inside_a_draft_ends_at_the_same_token(engine: Engine, ending: str) -> None:
    sampling = ENDINGS[ending]
    plain = run(engine, "copy", f"plain-end-{ending}", dataclasses.replace(sampling, speculate=False))
    drafted = run(engine, "copy", f"drafted-end-{ending}", sampling)
    assert plain[1].stop_reason == ("stop_sequence" if ending == "stop" else "max_tokens")
    assert drafted[1].n_draft_accepted > 0
    assert_same_turn(engine, plain, drafted, (f"plain-end-{ending}", f"drafted-end-{ending}"))


def test_a_drafting_sequence_beside_plain_ones_in_a_batch(engine: Engine) -> None:
    """The copy reply starts alone (drafting), the others join (it takes batched steps),
    they end first (it drafts again): every answer is the one it gets alone without drafts."""
    solo = {name: run(engine, name, f"solo-{name}", dataclasses.replace(GREEDY, speculate=False))
            for name in PROMPTS}
    sampling = {"copy": dataclasses.replace(GREEDY, max_tokens=64),
                "tool": dataclasses.replace(GREEDY, max_tokens=24, speculate=False),
                "prose": dataclasses.replace(GREEDY, max_tokens=24)}
    results: dict[str, tuple[str, Finished]] = {}
    started = threading.Event()

    def read(name: str) -> None:
        job = engine.submit(GenerationRequest(f"req-mixed-{name}", engine.render(PROMPTS[name]), sampling[name],
                                              f"agent-mixed-{name}", f"mixed-{name}"))
        events = []
        for event in job.events():
            events.append(event)
            if isinstance(event, TextDelta) and sum(isinstance(e, TextDelta) for e in events) >= 4:
                started.set()
        results[name] = ("".join(e.text for e in events if isinstance(e, TextDelta)), events[-1])

    batched_before = sum(n for rows, n in engine.status().counters.steps_by_batch.items() if rows > 1)
    first = threading.Thread(target=read, args=("copy",))
    first.start()
    assert started.wait(120)
    others = [threading.Thread(target=read, args=(name,)) for name in ("tool", "prose")]
    for thread in others:
        thread.start()
    for thread in [first, *others]:
        thread.join()
    assert wait_idle(engine)  # the last reply ended before its cache was committed
    assert sum(n for rows, n in engine.status().counters.steps_by_batch.items() if rows > 1) > batched_before
    assert results["copy"][1].n_draft_accepted > 0
    for name in PROMPTS:
        n = sampling[name].max_tokens
        assert results[name][1].output_token_ids == solo[name][1].output_token_ids[:n], name
        record = cache_manager(engine).record(f"mixed-{name}")
        finished = results[name][1]
        assert record is not None and record.n_tokens == finished.n_prompt_tokens + finished.n_output_tokens


def test_the_cache_handed_back_holds_the_prompt_and_the_used_tokens_only(smollm2_dir: Path) -> None:
    """Drafted and plain decoding of the same prompt: after ``remove`` (the drafted one
    handed tokens past the end, which it gives back), both caches hold the same tokens'
    keys and values."""
    loaded = load_model("smollm2", smollm2_dir)
    model = loaded.model
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS["copy"][0].content}],
                                                  add_generation_prompt=True)
    outputs, caches = [], []
    for max_draft in (0, 8):
        cache = [KVCache() for _ in model.layers]
        prefill(model, cache, prompt[:-1])
        batch = DecodeBatch(model, max_draft)
        batch.add(1, cache, prompt[-1], prompt[:-1], greedy_sampler, [], speculate=True)
        tokens: list[int] = []
        while len(tokens) < 41:
            tokens += [t for _, step in batch.step() for t in step]
        if max_draft:
            assert batch.drafts(1)[1] > 0
        caches.append(batch.remove(1, len(tokens) - 41))
        outputs.append(tokens[:41])
    assert outputs[0] == outputs[1]
    for plain, drafted in zip(*caches):
        assert plain.offset == drafted.offset == len(prompt) + 41
        n = plain.offset
        for a, b in ((plain.keys, drafted.keys), (plain.values, drafted.values)):
            assert mx.allclose(a[..., :n, :], b[..., :n, :], atol=1e-3).item()


def test_a_sampling_sequence_speculates_and_its_cache_holds_what_it_was_handed(smollm2_dir: Path) -> None:
    """At temperature 0.3 the copy reply keeps drafts; after ``remove`` the cache is the
    prompt's and the handed-out tokens' (as a fresh prefill of them computes it)."""
    loaded = load_model("smollm2", smollm2_dir)
    model = loaded.model
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS["copy"][0].content}],
                                                  add_generation_prompt=True)
    cache = [KVCache() for _ in model.layers]
    prefill(model, cache, prompt[:-1])
    batch = DecodeBatch(model, 8)
    batch.add(1, cache, prompt[-1], prompt[:-1], make_sampler(temp=0.3), [], speculate=True,
              distribution=token_distribution(0.3))
    tokens: list[int] = []
    while len(tokens) < 41:
        tokens += [t for _, step in batch.step() for t in step]
    assert batch.drafts(1)[1] > 0
    drafted = batch.remove(1, len(tokens) - 41)
    fresh = [KVCache() for _ in model.layers]
    prefill(model, fresh, [*prompt, *tokens[:41]])
    for a, b in zip(drafted, fresh):
        assert a.offset == b.offset == len(prompt) + 41
        n = b.offset
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-2).item()


def test_only_caches_that_trim_exactly_speculate() -> None:
    assert can_trim_exactly([KVCache(), KVCache()])
    assert not can_trim_exactly([KVCache(), RotatingKVCache(max_size=8)])
    assert not can_trim_exactly([KVCache(), ArraysCache(2)])  # recurrent state: no drafts
    assert not can_trim_exactly([CacheList(ArraysCache(2), KVCache())])  # falcon_h1's layers
    assert not can_trim_exactly([])


def test_sequences_drafting_together_each_keep_their_own_draft(smollm2_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences speculate in one forward pass a step (``Lanes``): the copy reply
    and the tool call greedily, the story sampled at 0.3. Each row accepts its own
    share of its draft (the others' rows drop theirs as holes), so the greedy rows hand
    out what each hands out decoding alone without drafts, and every row's cache handed
    back is its prompt's and its tokens' (as a fresh prefill computes it). Rows are
    rebuilt once a row holds more than 2 holes, so both the masked holes and the
    rebuilds are on the path."""
    monkeypatch.setattr(Lanes, "MAX_HOLES", 2)
    loaded = load_model("smollm2", smollm2_dir)
    model = loaded.model
    prompts = {name: loaded.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in PROMPTS[name]], add_generation_prompt=True)
        for name in PROMPTS}
    wanted = {"copy": 41, "tool": 24, "prose": 24}
    temperature = {"copy": 0.0, "tool": 0.0, "prose": 0.3}

    names = list(PROMPTS)
    together, caches, accepted = decode(model, prompts, wanted, temperature, names, 8)
    assert accepted["copy"] >= 10 and accepted["tool"] > 0, accepted  # drafts kept beside each other
    for name in ("copy", "tool"):
        alone, _, _ = decode(model, prompts, wanted, temperature, [name], 0)
        assert together[name] == alone[name], name
    assert_caches_are_fresh_prefills(model, prompts, together, caches)


# A module long enough that Gemma 3's prompts and replies outgrow its 512-token sliding window.
LONG_FILE = "".join(f'''def {name}(values, factor={i}):
    """Return every value of values {verb} by factor."""
    return [{expr} for v in values]


''' for i, (name, verb, expr) in enumerate(
    (f"{op}_{kind}", verb, expr) for kind in ("ints", "floats", "items", "rows")
    for op, verb, expr in (("scale", "multiplied", "v * factor"), ("shift", "increased", "v + factor"),
                           ("lower", "decreased", "v - factor"), ("split", "divided", "v / factor"))))


def test_gemma3_drafts_beyond_its_sliding_window_change_nothing(gemma3_dir: Path) -> None:
    """Gemma 3 270M (real weights; sliding-window layers on every cache, whose mask counts
    kept tokens only): two copy replies on prompts past the 512-token window decode
    together with drafts, each row keeping its own share (holes in the other), and each
    hands out what it hands out alone without drafts; the caches handed back are fresh
    prefills'. So do the two in a mixed batch, where one may not draft (plain batched steps
    for both). Fails if a row's window counted the other's rejected positions."""
    loaded = load_model("gemma3", gemma3_dir)
    model = loaded.model
    texts = {"copy": f"Here is ops.py:\n```python\n{LONG_FILE}```\nThe same file, with scale_ints renamed to "
                     f"times_ints:\n```python\n",
             "tail": f"Here is ops.py:\n```python\n{LONG_FILE}```\nIts last two functions again:\n```python\n"}
    prompts = {name: loaded.tokenizer.encode(text) for name, text in texts.items()}
    assert all(len(p) > 600 for p in prompts.values()), [len(p) for p in prompts.values()]
    wanted = {"copy": 48, "tail": 40}
    temperature = {"copy": 0.0, "tail": 0.0}
    names = list(texts)
    together, caches, accepted = decode(model, prompts, wanted, temperature, names, 8)
    assert accepted["copy"] >= 10 and accepted["tail"] >= 10, accepted
    for name in names:
        alone, _, _ = decode(model, prompts, wanted, temperature, [name], 0)
        assert together[name] == alone[name], name
    assert_caches_are_fresh_prefills(model, prompts, together, caches)
    # Mixed: the copy reply may draft, the other may not, so both take plain batched steps
    # (mlx-lm's batch, its window over left-padded rows) and hand out the same tokens.
    mixed, caches, accepted = decode(model, prompts, wanted, temperature, names, 8, plain=frozenset({"tail"}))
    assert accepted == {"copy": 0, "tail": 0}, accepted
    assert mixed == together
    assert_caches_are_fresh_prefills(model, prompts, mixed, caches)


def decode(model: Any, prompts: dict[str, list[int]], wanted: dict[str, int], temperature: dict[str, float],
           names: list[str], max_draft: int, plain: frozenset[str] = frozenset(),
           ) -> tuple[dict[str, list[int]], dict[str, list[KVCache]], dict[str, int]]:
    """``names`` decoding together in one ``DecodeBatch`` (drafting: ``max_draft`` > 0, but not
    those in ``plain``), each until it has ``wanted[name]`` tokens: (the tokens, the caches
    handed back, drafts accepted)."""
    batch = DecodeBatch(model, max_draft)
    for uid, name in enumerate(names):
        cache = [KVCache() for _ in model.layers]
        prefill(model, cache, prompts[name][:-1])
        batch.add(uid, cache, prompts[name][-1], prompts[name][:-1], make_sampler(temp=temperature[name]), [],
                  speculate=name not in plain, distribution=token_distribution(temperature[name]))
    tokens: dict[str, list[int]] = {name: [] for name in names}
    while any(len(tokens[name]) < wanted[name] for name in names):
        for uid, step in batch.step():
            tokens[names[uid]] += step
    accepted = {name: batch.drafts(uid)[1] for uid, name in enumerate(names)}  # every row decoding
    caches = {name: batch.remove(uid, len(tokens[name]) - wanted[name]) for uid, name in enumerate(names)}
    return {name: tokens[name][:wanted[name]] for name in names}, caches, accepted


def assert_caches_are_fresh_prefills(model: Any, prompts: dict[str, list[int]], tokens: dict[str, list[int]],
                                     caches: dict[str, list[KVCache]]) -> None:
    """Each cache handed back holds its prompt's and its tokens' keys, as a fresh prefill computes them."""
    for name, handed in caches.items():
        fresh = [KVCache() for _ in model.layers]
        prefill(model, fresh, [*prompts[name], *tokens[name]])
        for a, b in zip(handed, fresh):
            assert a.offset == b.offset == len(prompts[name]) + len(tokens[name])
            n = b.offset
            assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-2).item(), name
