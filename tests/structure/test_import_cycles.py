"""Zero import cycles among the project's modules (``engine/``, ``kernels/``, ``operator/``,
``contract/``), module-level and function-level imports alike: a function-level import
that closes a cycle only hides it until that function runs. The graph is read from the
source (``support.import_graph``), so nothing is imported here."""

from __future__ import annotations

from support.import_graph import cycles, import_graph, strongly_connected


def test_the_graph_finds_every_cycle_with_its_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert cycles(graph) == [["a", "b", "c", "a"]]
    # two cycles through one module: both reported
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"b"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "a"], ["c", "b", "c"]]


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert len(graph) > 200
    # module level, absolute
    assert "kvpilot.engine.core.block_pool" in graph["kvpilot.engine.core.kv_cache_manager"]
    # function level (inside Tokenizer.from_pretrained)
    assert "kvpilot.engine.text.gguf_tokenizer" in graph["kvpilot.engine.text.tokenizer"]
    # ``from package import module``
    assert "kvpilot.contract.constants" in graph["kvpilot.engine.server.vllm_flags"]
    # TYPE_CHECKING-only imports are not edges (engine.core.request types its LoRA request)
    assert "kvpilot.engine.lora.request" not in graph["kvpilot.engine.core.request"]


def test_no_import_cycles():
    found = cycles()
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)
