"""Speculative decoding: propose draft tokens cheaply, verify them in one target step.

- ``ngram``: prompt lookup over a request's own tokens (numpy).
- ``rejection_sampler``: verification, vectorised over the batch: greedy = longest prefix
  equal to the target's argmax; sampled = rejection sampling (exact target distribution).
- ``decoder``: the runner's side: a step's drafts written into the persistent batch,
  their scored rows verified, the next drafts proposed.
- ``model_drafter``: drafting with a model of its own, its KV in the target's blocks;
  ``draft_model`` / ``eagle`` are the two such models.
- ``proposer``: picks the proposer for a config and applies ``disable_by_batch_size``.

``SpeculativeConfig`` (vLLM's ``--speculative-config`` fields) is in
``kvpilot.contract.speculative``: the flag parser and the operator's planner read it too.
The scheduler side (requests carry ``spec_token_ids``; rejected positions roll back
``num_computed_tokens``; the verified drafts' counters, ``core.spec_stats``) lives in
``kvpilot.engine.core``.

May import: torch and numpy, ``kvpilot.contract``, ``kvpilot.engine.core`` and
``kvpilot.engine.model``.
"""
