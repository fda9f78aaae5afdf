"""Values that cross layer boundaries: chat messages, sampling, engine events.

Pure: no MLX, no database, no threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]

MAX_STOP_SEQUENCES = 16  # each checked on every generated token
MAX_STOP_CHARS = 256
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600  # a TTL beyond ten years is a mistake (and overflows dates)
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"  # agent ids, wherever they come from
# Stored KV formats (setting kv_format), defined in app/cache/formats.py.
KV_FORMAT_NAMES = ("q4r", "q4c", "k5c", "k6v4", "k8v4", "q8", "f16", "f32")
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "cancelled"]
# How cache reuse ended for a request: the one vocabulary of the matcher, the cache manager,
# the ``requests.reuse_reason`` column and the ``semantic_cache_reuse_reasons`` metric.
# ``extend`` / ``exact``: the conversation's cache continues (the prompt extends its text, or
# repeats it); ``diverge``: the conversation's stored text parted from the prompt (an edit);
# ``sibling``: started from another conversation of the agent; ``shared``: from blocks
# another conversation stored for the same prefix; ``miss``: nothing reusable; ``off``:
# reuse disabled, or a request with no conversation to store.
ReuseReason = Literal["extend", "exact", "diverge", "sibling", "shared", "miss", "off"]
# Where a turn's reused prefix was read from (docs/api.md, ``x-semantic-cache``): ``memory``
# (it stayed there since the turn that stored it), ``disk`` (read from this home's files since:
# on demand, or by the prefetch after a restart), ``tier`` (fetched from a pool's shared tier
# since), ``none`` (nothing reused).
CacheSource = Literal["memory", "disk", "tier", "none"]


@dataclass(frozen=True, slots=True)
class ForkPoint:
    """Where a fork's copy of a conversation's cache ends: before the text of the first
    message the fork leaves out, so no later turn's text or KV reaches the fork.

    ``kept``: the texts of the messages the fork keeps, in order; ``dropped``: the first
    left-out message's text ("" when it has none). Texts are found in the cache's text in
    order, each after the one before, so a text found early only cuts earlier (see
    ``app/cache/records.py``, ``fork_cut``)."""

    kept: tuple[str, ...]
    dropped: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of a tool: found in a reply, or an earlier one of the conversation."""

    name: str
    arguments: dict[str, Any]
    id: str = ""  # the client's id of an earlier call ("" for one found in a reply)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message as the chat template sees it (content already flattened to text).

    ``tool_calls`` and role "tool" appear only for a model whose template writes tool calls
    itself (``ToolSyntax``); otherwise calls and results are text in ``content``.
    """

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # role "tool": the id of the call this result answers


@dataclass(frozen=True)
class ToolSyntax:
    """How a model writes tool calls, when its chat template defines tools: the markers
    around a call and the ``mlx_lm.tool_parsers`` function that reads what is between
    them (as ``mlx_lm.server`` picks them for the tokenizer)."""

    parser: str  # the mlx_lm.tool_parsers module, e.g. "json_tools"
    call_start: str
    call_end: str  # "": a call runs to the end of the reply (Mistral)
    # What the template writes from the start of a reply up to a called tool's name (None: the
    # template did not show it), and from the name to where its arguments start: a forced call
    # starts the reply with them.
    call_head: str | None
    name_tail: str
    parse: Callable[[str, Any], Any] = field(compare=False, repr=False)  # (text, tools) -> call dict(s)


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (OpenAI's limit)


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """The reply held to a grammar (structured outputs): every token is drawn from those the
    grammar allows after the reply so far (``app/engine/grammar.py`` masks the rest).

    Plain data: ``grammar`` is llguidance's grammar text (``llguidance.LLMatcher`` takes it,
    ``app/protocol/structured.py`` makes it), ``prefix`` the start of the reply that the
    prompt already holds (a prefill, a forced tool call's start), which the grammar covers
    and the engine feeds it before the first token. ``what`` names it in logs and errors."""

    grammar: str
    prefix: str = ""
    what: str = "json_schema"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256  # 0: no output, prefill only
    stop_sequences: tuple[str, ...] = ()  # end the turn before these (not sent)
    end_after: tuple[str, ...] = ()  # end the turn once the output has one of these (sent): a tool call's end
    speculate: bool = True  # decoding may draft from the conversation (app/engine/speculation.py)
    constraint: OutputConstraint | None = None  # structured outputs (no drafts: a grammar masks each token)
    seed: int | None = None  # sampling draws from its own generator seeded so (no drafts); None: the shared one
    # Each output token's log-probability (and this many alternatives) comes back (no drafts); None: not asked.
    logprobs: int | None = None

    @property
    def may_draft(self) -> bool:
        """Whether decoding may draft (``speculate``, and nothing a draft would bypass or change:
        a grammar's mask, a seeded generator's order of draws, per-token log-probabilities)."""
        return self.speculate and self.constraint is None and self.seed is None and self.logprobs is None


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How the server reads requests (settings): what it fills in or bounds when a request
    leaves it open, which prompt transformations it applies, and the tool format of the
    model a request is served by."""

    max_output_tokens: int = 131072  # the largest max_tokens accepted
    default_temperature: float = 1.0  # for requests that name none
    default_max_tokens: int = 512  # for requests that name none (OpenAI, direct API)
    stable_prompts: bool = True  # app.protocol.claude_code: volatile spans made stable
    fit: bool = False  # drop optional sections (set when a prompt does not fit the context)
    tool_syntax: ToolSyntax | None = None  # the served model's own tool format (None: the generic one)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A rendered prompt: its exact text, token ids and each token's end offset in the text."""

    text: str
    token_ids: tuple[int, ...]
    ends: tuple[int, ...] = ()

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt: Prompt
    sampling: SamplingParams  # max_tokens 0: only prefill the prompt into the conversation's cache
    agent_id: str | None = None
    conversation_id: str | None = None  # whose cache the turn continues and updates
    whole_blocks: bool = False  # reuse only whole shared blocks (OpenAI cache_mode "prefix")
    persist: bool = True  # write the conversation's cache to disk (OpenAI ttl 0: memory only)
    hot_ttl_s: float | None = None  # keep it in memory only this long unused (Anthropic cache_control)
    model: str | None = None  # the model to run it on (None: the default model)
    # time.perf_counter() when its HTTP request arrived: its time to first token counts from
    # there (None: from when it was submitted).
    arrived_at: float | None = None
    staged_s: float = 0.0  # seconds spent before the queue restoring its cache's files (a pool's tier)


@dataclass(frozen=True, slots=True)
class Started:
    """Prefill is about to start: the prompt's size and how much of it is cached."""

    n_prompt_tokens: int
    n_cached_tokens: int  # read from a cache
    n_cache_written: int  # prompt tokens this turn adds to the conversation's cache
    reuse: ReuseReport | None = None  # the lease's report (its provenance): known before prefill


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An output token's log-probability under the distribution it was drawn from (after
    the server's repetition penalty and a grammar's mask, before temperature and top-p/k),
    and the most likely tokens there (``top``: each one's logprob; asked for by the request)."""

    token: str  # its text (an incomplete UTF-8 character as U+FFFD; ``bytes`` has it exactly)
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New output text (may span several tokens or none: stop-sequence hold-back);
    ``logprobs``: the tokens generated since the last delta, when the request asked."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ReuseReport:
    """How cache reuse ended for one request, and where the prompt parted from the best
    stored text (cache-miss diagnostics)."""

    reason: ReuseReason
    n_chars: int = 0  # prompt characters served from cache
    offset: int | None = None  # where the best stored text parted from the prompt
    stored: str | None = None  # the stored text around ``offset``
    new: str | None = None  # the prompt around ``offset``
    part: str | None = None  # the piece of the prompt ``offset`` falls in (set by the API)
    # Provenance: where the reused prefix was read from, how many prompt tokens it holds and
    # the stored KV format it was kept in (the model's caches' format: KV_FORMAT_NAMES).
    source: CacheSource = "none"
    n_tokens: int = 0
    kv_format: str | None = None


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The KV cache manager's memory and what it holds (the engine's status reports it)."""

    enabled: bool
    pool_bytes: int
    budget_bytes: int
    n_blocks: int
    n_free_blocks: int  # cached in memory, referenced by no conversation
    hot_agents: int
    hot_conversations: int
    n_spilled: int


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a generation."""

    stop_reason: StopReason
    stop_sequence: str | None
    n_prompt_tokens: int
    n_cached_tokens: int
    n_cache_written: int
    n_output_tokens: int
    ttft_s: float  # from the request's arrival to its first token (0.0: it generated none)
    total_s: float  # from the request's arrival to its end
    output_token_ids: tuple[int, ...] = field(default=(), repr=False)
    reuse: ReuseReport | None = None  # None: the request never reached the cache (cancelled in the queue)
    # ttft_s in parts (app.engine.timing.FirstToken; with no token, up to the turn's end):
    queue_s: float = 0.0  # arrival until the engine thread took it (reading, rendering, the queue)
    restore_s: float = 0.0  # its cache brought into memory as a working copy (from disk, a pool's tier)
    prefill_s: float = 0.0  # the prompt's new tokens computed, until the first token
    n_draft_tokens: int = 0  # speculative draft tokens proposed (app/engine/speculation.py)
    n_draft_accepted: int = 0  # of which the model's own greedy choice agreed with
    logprobs: tuple[TokenLogprob, ...] = field(default=(), repr=False)  # every output token's (when asked)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Nothing new for a while (a long prefill): streams send a keep-alive, which carries
    the prefill's progress when there is one: ``n_ready`` of the prompt's ``n_prompt``
    tokens in the cache (reused or computed); 0 of 0 otherwise."""

    n_ready: int = 0
    n_prompt: int = 0


GenerationEvent = Started | TextDelta | Finished | Heartbeat
