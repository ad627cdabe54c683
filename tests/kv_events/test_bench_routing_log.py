"""``kvpilot bench routing`` and ``bench routing-cost`` read vllm-router's own debug log
for what its kv_aware policy made of kvpilot's events: the decisions, the prompt tokens
routed and the tokens it took as cached. The lines below are vllm-router 0.1.17's, copied
with their colour codes from a bench run's log (the router writes them so even to a
file)."""

from __future__ import annotations

from kvpilot.engine.bench.routing import router_log

E = "\x1b"
SUBSCRIBED = (f"{E}[2m2026-12-04 04:31:42{E}[0m {E}[32m INFO{E}[0m {E}[2mvllm_router_rs::kv_index::subscriber"
              f"{E}[0m{E}[2m:{E}[0m {E}[2msrc/kv_index/subscriber.rs{E}[0m{E}[2m:{E}[0m{E}[2m158:{E}[0m "
              "kv_index subscriber for http://127.0.0.1:52609 rank0 on tcp://127.0.0.1:45801")
ADVANCED = (f"{E}[2m2026-12-04 04:31:43{E}[0m {E}[34mDEBUG{E}[0m {E}[2mvllm_router_rs::kv_index::subscriber"
            f"{E}[0m{E}[2m:{E}[0m {E}[2msrc/kv_index/subscriber.rs{E}[0m{E}[2m:{E}[0m{E}[2m377:{E}[0m "
            f"kv_index live sequence advanced {E}[3msource{E}[0m{E}[2m={E}[0mhttp://127.0.0.1:52609 "
            f"{E}[3mrank{E}[0m{E}[2m={E}[0m0 {E}[3mseq{E}[0m{E}[2m={E}[0m0")


def decision(input_tokens: int, new: int, credited: int) -> str:
    return (f"{E}[2m2026-12-04 04:31:43{E}[0m {E}[34mDEBUG{E}[0m {E}[2mvllm_router_rs::policies::kv_aware"
            f"{E}[0m{E}[2m:{E}[0m {E}[2msrc/policies/kv_aware.rs{E}[0m{E}[2m:{E}[0m{E}[2m1314:{E}[0m "
            f"KV prefix decision {E}[3moutcome{E}[0m{E}[2m={E}[0m\"prefix_cost\" {E}[3mworker{E}[0m{E}[2m="
            f"{E}[0m\"http://127.0.0.1:46217\" {E}[3minput_tokens{E}[0m{E}[2m={E}[0m{input_tokens} "
            f"{E}[3mnew_prefill_tokens{E}[0m{E}[2m={E}[0m{new} {E}[3mcredited_prefix_tokens{E}[0m"
            f"{E}[2m={E}[0m{credited} {E}[3mused_binding{E}[0m{E}[2m={E}[0mfalse")


def test_the_router_log_gives_its_decisions_and_credited_tokens(tmp_path):
    path = tmp_path / "router.log"
    lines = [SUBSCRIBED, ADVANCED, decision(1046, 1046, 0), "an unrelated line input_tokens=5",
             decision(1037, 45, 992), decision(1104, 64, 1040)]
    path.write_text("\n".join(lines) + "\n")
    log = router_log(path)
    assert (log.decisions, log.credited_decisions) == (3, 2)
    assert log.input_tokens == 1046 + 1037 + 1104
    assert log.credited_tokens == 992 + 1040
    # shown without colour codes: the subscription, the sequence, the first and last credited
    assert log.shown[0].endswith("kv_index subscriber for http://127.0.0.1:52609 rank0 on tcp://127.0.0.1:45801")
    assert "seq=0" in log.shown[1]
    assert "credited_prefix_tokens=992" in log.shown[-2] and "credited_prefix_tokens=1040" in log.shown[-1]
    assert all(E not in line for line in log.shown)


def test_a_log_without_kv_aware_decisions_counts_nothing(tmp_path):
    path = tmp_path / "router.log"
    path.write_text(SUBSCRIBED + "\n")
    log = router_log(path)
    assert (log.decisions, log.credited_decisions, log.input_tokens, log.credited_tokens) == (0, 0, 0, 0)


def test_routing_cost_reads_each_decision_in_order(tmp_path):
    from kvpilot.engine.bench.routing_cost import Decision, decisions

    path = tmp_path / "router.log"
    path.write_text("\n".join([SUBSCRIBED, decision(1000, 1000, 0), ADVANCED, decision(3998, 3006, 992)]) + "\n")
    assert decisions(path) == [Decision("http://127.0.0.1:46217", 1000, 1000, 0),
                               Decision("http://127.0.0.1:46217", 3998, 3006, 992)]
