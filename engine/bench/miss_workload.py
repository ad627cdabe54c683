"""A chat workload with eight planted prefix-cache miss causes, and the attribution check.

Each ``PlantedMiss`` is a conversation sent once to warm the cache (the *seed*), then sent
again changed in one way (the *probe*), so that the probe's uncached prompt tokens have
one known cause:

==========================  ===========================================  ======================
cause                       the probe                                    counter reason
==========================  ===========================================  ======================
evicted                     the seed again, after fillers evicted it     evicted_capacity
different_cache_salt        the seed under another ``cache_salt``        different_cache_salt
different_lora_adapter      the seed under a LoRA adapter                different_lora_adapter
edited_system_prompt        one word of the system prompt changed        divergence
template_whitespace         a chat template with one more newline        divergence
date_in_system_prompt       the system prompt's date a day later         divergence
wrong_replica               the seed again, on the other replica         never_seen
last_partial_block          the seed again (its last block is partial)   last_partial_block
==========================  ===========================================  ======================

``run`` sends them through engines (``kvpilot.engine.LLM`` instances; the second is the
other replica behind a round robin) one at a time and reads each probe's counters
(``EngineStats.prefix_miss_*``) before and after it: the share of the probe's uncached
tokens counted under the expected reason is the attribution. Token-granular reuse must be
off for the last-partial-block cause (it would serve the tail from the seed's block).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from kvpilot.engine.core.prefix_miss import (
    DIFFERENT_CACHE_SALT,
    DIFFERENT_LORA_ADAPTER,
    DIVERGENCE,
    EVICTED_CAPACITY,
    LAST_PARTIAL_BLOCK,
    MISS_REASONS,
    NEVER_SEEN,
)

EXPECTED_REASON = {
    "evicted": EVICTED_CAPACITY,
    "different_cache_salt": DIFFERENT_CACHE_SALT,
    "different_lora_adapter": DIFFERENT_LORA_ADAPTER,
    "edited_system_prompt": DIVERGENCE,
    "template_whitespace": DIVERGENCE,
    "date_in_system_prompt": DIVERGENCE,
    "wrong_replica": NEVER_SEEN,
    "last_partial_block": LAST_PARTIAL_BLOCK,
}
CAUSES = tuple(EXPECTED_REASON)
# ChatML, and the same with one more newline after each message's content.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATE_WITH_NEWLINE = TEMPLATE.replace("{{ m['content'] }}<|im_end|>", "{{ m['content'] }}\n<|im_end|>")
WORDS = ("cache", "block", "token", "prefix", "replica", "router", "tenant", "answer", "policy",
         "request", "latency", "budget", "schedule", "memory", "kernel", "adapter", "service",
         "operator", "cluster", "queue", "window", "batch", "stream", "model", "prompt", "value")


@dataclass(frozen=True, slots=True)
class Chat:
    """One request of the workload: a conversation and how it is sent."""

    messages: tuple[tuple[str, str], ...]       # (role, content)
    cache_salt: str | None = None
    lora_name: str | None = None
    chat_template: str = TEMPLATE
    replica: int = 0

    def body(self, model: str) -> dict:
        """As a ``/v1/chat/completions`` body (the served ``model``, or the adapter)."""
        body = {"model": self.lora_name or model,
                "messages": [{"role": r, "content": c} for r, c in self.messages]}
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return body


@dataclass(frozen=True, slots=True)
class PlantedMiss:
    cause: str
    seed: Chat
    probe: Chat
    fillers: tuple[Chat, ...] = ()   # sent between seed and probe (to evict the seed)


@dataclass(slots=True)
class Attribution:
    """What the probe's replica counted while serving it."""

    cause: str
    uncached: int                                   # the probe's uncached prompt tokens
    by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def share(self) -> float:
        """Share of the uncached tokens counted under the cause's reason (1.0: none missed)."""
        if not self.uncached:
            return 1.0
        return self.by_reason.get(EXPECTED_REASON[self.cause], 0) / self.uncached


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _system_prompt(rng: random.Random, sentences: int) -> str:
    return "You are the assistant of a platform team. " + " ".join(
        _sentence(rng, rng.randint(6, 12)) for _ in range(sentences))


def planted_workload(seed: int = 0, *, adapter: str | None = "adapter", sentences: int = 12,
                     num_fillers: int = 8, filler_sentences: int = 24) -> list[PlantedMiss]:
    """The eight planted misses (``CAUSES``; without ``adapter`` the adapter one is left out),
    each on its own random system prompt of ``sentences`` sentences."""
    rng = random.Random(seed)
    planted = []
    for cause in CAUSES:
        if cause == "different_lora_adapter" and adapter is None:
            continue
        system = _system_prompt(rng, sentences)
        if cause == "date_in_system_prompt":
            system += " Today's date is 2025-03-14."
        chat = Chat((("system", system), ("user", _sentence(rng, 10))))
        probe, fillers = chat, ()
        if cause == "evicted":
            fillers = tuple(Chat((("system", _system_prompt(rng, filler_sentences)),
                                  ("user", _sentence(rng, 10)))) for _ in range(num_fillers))
        elif cause == "different_cache_salt":
            chat, probe = replace(chat, cache_salt="tenant-a"), replace(chat, cache_salt="tenant-b")
        elif cause == "different_lora_adapter":
            probe = replace(chat, lora_name=adapter)
        elif cause == "edited_system_prompt":
            words = system.split(" ")
            middle = len(words) // 2
            words[middle] = "definitely" if words[middle] != "definitely" else "surely"
            probe = replace(chat, messages=(("system", " ".join(words)), chat.messages[1]))
        elif cause == "template_whitespace":
            probe = replace(chat, chat_template=TEMPLATE_WITH_NEWLINE)
        elif cause == "date_in_system_prompt":
            probe = replace(chat, messages=(("system", system.replace("2025-03-14", "2025-03-15")),
                                            chat.messages[1]))
        elif cause == "wrong_replica":
            probe = replace(chat, replica=1)
        planted.append(PlantedMiss(cause, chat, probe, fillers))
    return planted


def prompt_ids(tokenizer, chat: Chat) -> list[int]:
    """The conversation through its chat template, as token ids."""
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in chat.messages],
                                         add_generation_prompt=True, chat_template=chat.chat_template)
    return tokenizer.encode(text, add_special_tokens=False)


def _misses(llm) -> dict[str, int]:
    stats = llm.get_stats()
    return {reason: getattr(stats, f"prefix_miss_{reason}") or 0 for reason in MISS_REASONS}


def _send(llms, chat: Chat, params) -> object:
    llm = llms[chat.replica]
    return llm.generate([prompt_ids(llm.get_tokenizer(), chat)], params, cache_salt=chat.cache_salt,
                        lora_name=chat.lora_name)[0]


def run(llms, planted: list[PlantedMiss], params) -> list[Attribution]:
    """Send each planted miss through ``llms`` (``[replica 0, replica 1]``, ``kvpilot.engine.LLM``)
    and return each probe's attribution."""
    results = []
    for miss in planted:
        _send(llms, miss.seed, params)
        for filler in miss.fillers:
            _send(llms, filler, params)
        target = llms[miss.probe.replica]
        before = _misses(target)
        out = _send(llms, miss.probe, params)
        after = _misses(target)
        delta = {r: after[r] - before[r] for r in MISS_REASONS if after[r] != before[r]}
        results.append(Attribution(miss.cause, len(out.prompt_token_ids) - out.num_cached_tokens, delta))
    return results


def table(results: list[Attribution]) -> str:
    """The attributions as a text table."""
    lines = [f"{'cause':<24} {'uncached':>8} {'expected reason':<22} {'share':>7}  counted"]
    for r in results:
        lines.append(f"{r.cause:<24} {r.uncached:>8} {EXPECTED_REASON[r.cause]:<22} "
                     f"{r.share:>7.1%}  {r.by_reason}")
    return "\n".join(lines)
