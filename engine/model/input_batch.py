"""The persistent batch: one preallocated row per request the runner is serving.

As in vLLM v1's ``InputBatch``, a request gets a row the first step it is scheduled
(its prompt and any output tokens copied in once) and keeps it until it finishes or
is preempted. The row holds its token ids, its block table and its sampling
parameters in numpy arrays, so a step touches only what changed: blocks appended since
the last step, the token each request just sampled. Building a step's inputs and its
sampling parameters are then vectorised gathers over the scheduled rows instead of
loops that rebuild Python lists per request.

NOTE (invariants):
- ``num_tokens[row]`` equals the request's ``num_tokens``: the runner appends every
  sampled token here (``append_sampled``, ``append_token_lists``) exactly when the
  scheduler appends it to the request. A step's draft tokens (speculative decoding) are
  written past it (``write_drafts``) without counting: the step's inputs and the
  verification's penalties read them there, and the accepted ones are then appended over
  themselves.
- ``block_table[row, :num_blocks[row]]`` equals the KV cache manager's table for the
  request (tables only grow while a request holds its blocks; a preempted request
  loses its row and gets a fresh one when it is scheduled again). With several KV cache
  groups (a hybrid model) ``block_tables[g]`` / ``group_num_blocks[g]`` hold group
  ``g``'s table the same way; group 0's are ``block_table`` / ``num_blocks``.
- The token array is allocated with ``np.empty``: pages of rows never written are never
  touched, so a long ``max_model_len`` costs address space, not memory.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.engine.core.request import Request
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.model.sampler import Penalties, SamplingMetadata


class InputBatch:
    """Rows for up to ``max_num_seqs`` requests of at most ``max_model_len`` tokens."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, device: torch.device, num_kv_groups: int = 1) -> None:
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        n = max_num_seqs
        self.token_ids = np.empty((n, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(n, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(n, dtype=np.int64)
        self.block_tables = [np.zeros((n, self.max_blocks_per_seq), dtype=np.int32)
                             for _ in range(num_kv_groups)]
        self.group_num_blocks = [[0] * n for _ in range(num_kv_groups)]
        self.block_table = self.block_tables[0]
        self.num_blocks = self.group_num_blocks[0]
        self.req_ids: list[str | None] = [None] * n
        self.requests: list[Request | None] = [None] * n
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(n - 1, -1, -1))
        # Sampling parameters per row, and how many rows need each optional feature.
        self.temperature = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.repetition = np.ones(n, dtype=np.float32)
        self.presence = np.zeros(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.is_random = np.zeros(n, dtype=bool)
        self.penalized = np.zeros(n, dtype=bool)
        self._features = np.zeros((n, 7), dtype=np.int64)   # per row: the flags counted below
        self._counts = np.zeros(7, dtype=np.int64)
        self.generators: dict[str, torch.Generator] = {}    # survive preemption; dropped on finish

    # ---- rows ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def add(self, request: Request, block_ids: list[int],
            group_block_ids: tuple[list[int], ...] = ()) -> int:
        """Give ``request`` a row (prompt, outputs, block tables, sampling parameters)."""
        if not self._free_rows:
            raise RuntimeError(f"the persistent batch is full ({self.max_num_seqs} rows)")
        row = self._free_rows.pop()
        rid = request.request_id
        self.rows[rid] = row
        self.req_ids[row] = rid
        self.requests[row] = request
        num_prompt, num_tokens = request.num_prompt_tokens, request.num_tokens
        self.token_ids[row, :num_prompt] = request.prompt_token_ids
        if num_tokens > num_prompt:
            self.token_ids[row, num_prompt:num_tokens] = request.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        for group, ids in enumerate((block_ids, *group_block_ids)):
            self.block_tables[group][row, :len(ids)] = ids
            self.group_num_blocks[group][row] = len(ids)
        self._set_sampling(row, request)
        return row

    def update(self, out: SchedulerOutput) -> list[int]:
        """The one place a step changes the batch before its forward pass: finished
        requests leave (with their generators), preempted ones leave (keeping theirs for
        the recompute), a request scheduled for the first time (or again, after a
        preemption) gets a row, and block tables that grew are copied. Returns the row of
        each of ``out.scheduled``, in order (sampled tokens are added after the forward
        pass, ``append_sampled``)."""
        for request_id in out.finished_req_ids:
            self.release(request_id)
        for request_id in out.preempted_request_ids:
            self.remove(request_id)
        rows_of, num_blocks, group_num_blocks = self.rows, self.num_blocks, self.group_num_blocks
        rows = []
        for s in out.scheduled:
            row = rows_of.get(s.request.request_id)
            if row is None:
                row = self.add(s.request, s.block_ids, s.group_block_ids)
            else:
                if len(s.block_ids) != num_blocks[row]:
                    self.update_blocks(row, s.block_ids)
                for group, ids in enumerate(s.group_block_ids, 1):   # same length as group 0's
                    if len(ids) != group_num_blocks[group][row]:
                        self.update_blocks(row, ids, group)
            rows.append(row)
        return rows

    def remove(self, request_id: str) -> None:
        """Free a request's row (finished or preempted); unknown ids are ignored."""
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.requests[row] = None
        for table, num_blocks in zip(self.block_tables, self.group_num_blocks, strict=True):
            table[row, :num_blocks[row]] = 0   # no stale ids past a new table's end
            num_blocks[row] = 0
        self._counts -= self._features[row]
        self._features[row] = 0
        self._free_rows.append(row)

    def release(self, request_id: str) -> None:
        """A request finished: drop its row and its generator."""
        self.remove(request_id)
        self.generators.pop(request_id, None)

    def update_blocks(self, row: int, block_ids: list[int], group: int = 0) -> None:
        """Copy the blocks appended to a request's table (of KV cache group ``group``) since
        the last step."""
        num_blocks = self.group_num_blocks[group]
        known = num_blocks[row]
        if len(block_ids) > known:
            self.block_tables[group][row, known:len(block_ids)] = block_ids[known:]
            num_blocks[row] = len(block_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """Append each row's sampled token (vectorised)."""
        positions = self.num_tokens[rows]
        self.token_ids[rows, positions] = token_ids
        self.num_tokens[rows] = positions + 1

    def append_token_lists(self, rows: np.ndarray, token_lists: list[list[int]]) -> None:
        """Append each row's new tokens (a verification step's: one or more per row)."""
        token_ids, num_tokens = self.token_ids, self.num_tokens
        for row, tokens in zip(rows.tolist(), token_lists, strict=True):
            n = num_tokens[row]
            token_ids[row, n:n + len(tokens)] = tokens
            num_tokens[row] = n + len(tokens)

    def write_drafts(self, row: int, draft_token_ids) -> None:
        """Put a step's draft tokens after the row's tokens (not counted in ``num_tokens``)."""
        n = self.num_tokens[row]
        self.token_ids[row, n:n + len(draft_token_ids)] = draft_token_ids

    # ---- sampling -------------------------------------------------------------
    # Feature columns of _features / _counts (_SPECIAL: logprobs, min_tokens, logit_bias:
    # visited row by row).
    _RANDOM, _SEEDED, _TOP_K, _TOP_P, _MIN_P, _PENALTY, _SPECIAL = range(7)

    def _set_sampling(self, row: int, request: Request) -> None:
        p = request.sampling_params
        random = not p.is_greedy
        self.temperature[row] = p.temperature if random else 1.0
        self.top_k[row] = p.top_k if 0 < p.top_k < self.vocab_size else 0
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition[row] = p.repetition_penalty
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.min_tokens[row] = p.min_tokens if p.all_stop_token_ids else 0
        penalized = p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
        self.is_random[row] = random
        self.penalized[row] = penalized
        if random and p.seed is not None and request.request_id not in self.generators:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(p.seed)
            self.generators[request.request_id] = gen
        flags = (random, random and p.seed is not None, random and self.top_k[row] > 0,
                 random and p.top_p < 1.0, random and p.min_p > 0, penalized,
                 p.logprobs is not None or self.min_tokens[row] > 0 or bool(p.logit_bias))
        self._features[row] = flags
        self._counts += self._features[row]

    def sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> SamplingMetadata:
        """Sampling parameters of ``rows`` (the rows whose step samples), as tensors.

        ``offsets`` (speculative decoding: a row repeated once per scored position): how
        many of the row's drafts come before each position; penalties and ``min_tokens``
        then count them as the row's tokens there.
        """
        num = len(rows)
        meta = SamplingMetadata(num)
        counts = self._counts
        if not counts.any():
            return meta   # the common case: every row greedy, nothing else asked for
        if counts[self._RANDOM]:
            self._random_part(meta, rows)
        if counts[self._PENALTY]:
            self._penalty_part(meta, rows, offsets)
        if counts[self._SPECIAL]:
            for i, row in enumerate(rows.tolist()):
                params = self.requests[row].sampling_params
                if params.logprobs is not None:
                    meta.logprobs.append((i, params.logprobs))
                if params.logit_bias:
                    meta.logit_bias.append((
                        i, torch.tensor(list(params.logit_bias), dtype=torch.long, device=self.device),
                        torch.tensor(list(params.logit_bias.values()), device=self.device)))
                outputs = self.num_tokens[row] - self.num_prompt_tokens[row]
                if offsets is not None:
                    outputs += offsets[i]
                if outputs < self.min_tokens[row]:
                    ids = [t for t in params.all_stop_token_ids if t < self.vocab_size]
                    if ids:
                        meta.suppress.append((i, ids))
        return meta

    def _random_part(self, meta: SamplingMetadata, rows: np.ndarray) -> None:
        random = self.is_random[rows]
        if not random.any():
            return
        positions = np.flatnonzero(random)
        meta.all_random = len(positions) == len(rows)
        sub = rows[positions]
        meta.random_rows = torch.from_numpy(positions).to(self.device)
        meta.temperature = torch.from_numpy(self.temperature[sub]).to(self.device)
        counts = self._counts
        if counts[self._TOP_K]:
            meta.top_k = torch.from_numpy(self.top_k[sub]).to(self.device)
        if counts[self._TOP_P]:
            meta.top_p = torch.from_numpy(self.top_p[sub]).to(self.device)
        if counts[self._MIN_P]:
            meta.min_p = torch.from_numpy(self.min_p[sub]).to(self.device)
        if counts[self._SEEDED]:
            for i, row in enumerate(sub.tolist()):
                gen = self.generators.get(self.req_ids[row])
                if gen is not None:
                    meta.generators[i] = gen

    def _penalty_part(self, meta: SamplingMetadata, rows: np.ndarray, offsets: np.ndarray | None) -> None:
        positions = np.flatnonzero(self.penalized[rows])
        if not len(positions):
            return
        sub = rows[positions]
        lengths = self.num_tokens[sub]
        if offsets is not None:
            lengths = lengths + offsets[positions]
        width = int(lengths.max())
        index = np.arange(width)[None, :]
        valid = index < lengths[:, None]
        ids = np.where(valid, self.token_ids[sub, :width], self.vocab_size).astype(np.int64)
        is_output = valid & (index >= self.num_prompt_tokens[sub][:, None])
        dev = self.device
        meta.penalties = Penalties(
            rows=torch.from_numpy(positions).to(dev), token_ids=torch.from_numpy(ids).to(dev),
            is_output=torch.from_numpy(is_output).to(dev),
            repetition=torch.from_numpy(self.repetition[sub]).to(dev),
            presence=torch.from_numpy(self.presence[sub]).to(dev),
            frequency=torch.from_numpy(self.frequency[sub]).to(dev))
