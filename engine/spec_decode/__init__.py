"""Speculative decoding: propose draft tokens cheaply, verify them in one target step.

- ``config``: ``SpeculativeConfig`` (vLLM's ``--speculative-config`` fields; torch-free).
- ``metrics``: the verified drafts' counters (torch-free; the scheduler keeps them).
- ``ngram``: prompt lookup over a request's own tokens (numpy).
- ``rejection_sampler``: verification, vectorised over the batch: greedy = longest prefix
  equal to the target's argmax; sampled = rejection sampling (exact target distribution).
- ``verifier``: a step's scored positions: their logits rows, sampling parameters and
  grammar bitmask rows, and the tokens each request keeps.
- ``draft_model`` / ``eagle``: model-based proposers with their own KV in the target's
  blocks (``draft_inputs`` builds their steps).
- ``proposer``: picks the proposer for a config and applies ``disable_by_batch_size``.

The scheduler side (requests carry ``spec_token_ids``; rejected positions roll back
``num_computed_tokens``) lives in ``kvpilot.engine.core.scheduler``.

May import: torch and numpy (``config`` and ``metrics`` stay torch-free: the scheduler,
the flag parser and the operator read them), ``kvpilot.engine.core`` and ``kvpilot.engine.model``.
"""
