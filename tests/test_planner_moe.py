"""The planner's cost model for mixture-of-experts layers (issue #47, first step; ``plan`` still
refuses MoE models): expert sizes in ``Layout``, the expert all-to-all's in-node and cross-node
bytes and links under the alltoall and flex dispatchers, dense models untouched, and overlapped
pairs hiding the all-to-all under this cost model."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_pp_ext.planner import devices
from megatron_pp_ext.planner import search as search_module
from megatron_pp_ext.planner.costs import PlanCosts
from megatron_pp_ext.planner.layout import Layout, expert_layouts, layout_problem, layouts
from megatron_pp_ext.planner.pins import PinError, Pins
from megatron_pp_ext.planner.step import Problem
from megatron_pp_ext.schedule.flops import FlopCosts
from megatron_pp_ext.schedule.generators import SCHEDULES, generate
from megatron_pp_ext.schedule.ir import Op, OpKind
from megatron_pp_ext.schedule.lowering import lower
from megatron_pp_ext.schedule.memory_model import stage_layers
from megatron_pp_ext.schedule.models import ModelShape
from megatron_pp_ext.schedule.pairing import pair
from megatron_pp_ext.schedule.pairs import count
from megatron_pp_ext.schedule.replay import replay

H100 = devices.get_profile("h100-80gb")
SEQ = 4096
# Every layer MoE: 16 routed experts of width 1024, top-2, no shared expert.
MOE = ModelShape(
    "moe-test", 8, 1024, 8, 8, 128, 4096, 32000, experts=16, topk=2, expert_ffn=1024, moe_layer_freq=1
)
DENSE = MOE.as_dense()


def plan_costs(shape: ModelShape, layout: Layout, schedule=None, profile=H100, **options) -> PlanCosts:
    schedule = schedule or generate("1f1b", layout.pp, 2 * layout.pp)
    layers = stage_layers(shape.layers, schedule.num_stages)
    return PlanCosts(shape, schedule, SEQ, layout, profile, 1, layers_per_stage=layers, **options)


F, B, W = Op(OpKind.F, 0, 0), Op(OpKind.B, 0, 0), Op(OpKind.W, 0, 0)


@pytest.mark.parametrize(
    ("layout", "own_tokens", "inside", "across"),
    [
        (Layout(1, 1, 2, 8, gpus_per_node=8, ep=8), SEQ, 7 / 8, 0.0),  # EP8 in a node
        (Layout(1, 1, 2, 8, gpus_per_node=4, ep=8), SEQ, 3 / 8, 4 / 8),  # EP8 over 2 nodes of 4
        (Layout(2, 1, 2, 4, gpus_per_node=8, ep=4), SEQ / 2, 3 / 4, 0.0),  # ETP2 x EP4 = 8
        (Layout(2, 1, 2, 8, gpus_per_node=8, ep=8, etp=1), SEQ / 2, 7 / 8, 0.0),
        (Layout(2, 1, 2, 8, gpus_per_node=8, ep=8), SEQ / 2, 3 / 8, 4 / 8),  # ETP2 x EP8: 4 a node
    ],
    ids=lambda value: value.label() if isinstance(value, Layout) else None,
)
def test_one_moe_layer_s_all_to_all_by_hand(
    layout: Layout, own_tokens: float, inside: float, across: float
) -> None:
    """Alltoall dispatcher, per rank and all-to-all: its own tokens (b s / TP under SP) x top-k x
    h x 2 bytes, of which (c-1)/EP go to the other EP ranks of its node (c of them on a node: EP
    strided by ETP, gpus_per_node ranks a node) over NVLink and (EP-c)/EP to other nodes over IB,
    concurrently: max of the two plus one collective latency; F and B have two per MoE layer, W
    none."""
    costs = plan_costs(MOE, layout)
    copies = own_tokens * 2 * 1024 * 2  # top-2 copies of h = 1024 in bf16
    nvlink, ib = copies * inside, copies * across
    assert inside + across == pytest.approx((layout.ep - 1) / layout.ep)  # the first model's total
    seconds = max(nvlink / H100.nvlink_bandwidth, ib / H100.ib_bandwidth) + H100.collective_latency
    assert costs.alltoall_parts() == pytest.approx((nvlink, ib))
    assert costs.alltoall_bytes() == pytest.approx(nvlink + ib)
    assert costs.alltoall_seconds() == pytest.approx(seconds)
    assert costs.tokens_per_expert() == pytest.approx(own_tokens * 2 * layout.ep * layout.expert_tp / 16)
    layers = costs.moe_layers[0]
    assert layers == 4  # 8 MoE layers over 2 stages
    assert costs.expert_comm_time(F) == pytest.approx(2 * layers * seconds)
    assert costs.expert_comm_time(B) == pytest.approx(2 * layers * seconds)
    assert costs.expert_comm_time(W) == 0.0
    assert costs.expert_comm_time(Op(OpKind.BW, 0, 0)) == pytest.approx(2 * layers * seconds)


def test_flex_sends_a_token_across_once_per_node_by_hand() -> None:
    """EP8 over 2 nodes of 4, 16 experts top-2 (8 experts a node). Flex (DeepEP / HybridEP): a
    token crosses IB once if one of its 2 experts is on the other node, probability 1 - C(8, 2) /
    C(16, 2) = 1 - 28/120 = 23/30, against 4/8 x 2 = 1 copy under alltoall; in-node it sends its
    3/8 x 2 own-node copies and forwards the other node's (3 of 4 not on the receiving rank),
    2 x 3/4 copies. An all-to-all is the slower of the two links plus one latency."""
    layout = Layout(1, 1, 2, 8, gpus_per_node=4, ep=8)
    flex, alltoall = plan_costs(MOE, layout, dispatcher="flex"), plan_costs(MOE, layout)
    token = SEQ * 1024 * 2
    assert flex.ep_node_ranks() == [4, 4]
    assert flex.cross_nodes_per_token() == pytest.approx(23 / 30)
    assert flex.alltoall_parts() == pytest.approx((token * 2 * 3 / 4, token * 23 / 30))
    assert alltoall.alltoall_parts() == pytest.approx((token * 2 * 3 / 8, token * 2 * 4 / 8))
    assert flex.alltoall_parts()[1] < alltoall.alltoall_parts()[1]  # dedup: fewer IB bytes
    seconds = max(token * 1.5 / H100.nvlink_bandwidth, token * 23 / 30 / H100.ib_bandwidth)
    assert flex.alltoall_seconds() == pytest.approx(seconds + H100.collective_latency)
    assert flex.alltoall_seconds() < alltoall.alltoall_seconds()


def test_flex_dedup_with_many_experts_and_nodes() -> None:
    """128 experts top-8 over EP16 on 2 nodes (Qwen3-30B-A3B's run 4a): flex sends about one
    copy per token across (1 - C(64, 8) / C(128, 8)), alltoall 8 x 8/16 = 4."""
    shape = dataclasses.replace(MOE, experts=128, topk=8)
    layout = Layout(1, 1, 1, 16, gpus_per_node=8, ep=16)
    flex = plan_costs(shape, layout, schedule=generate("1f1b", 1, 2), dispatcher="flex")
    alltoall = plan_costs(shape, layout, schedule=generate("1f1b", 1, 2))
    token = SEQ * 1024 * 2
    reached = 1 - math.comb(64, 8) / math.comb(128, 8)
    assert 0.99 < reached < 1
    assert flex.alltoall_parts()[1] == pytest.approx(token * reached)
    assert alltoall.alltoall_parts()[1] == pytest.approx(token * 4)


@pytest.mark.parametrize(
    "layout",
    [Layout(1, 1, 2, 8, gpus_per_node=8, ep=8), Layout(2, 1, 2, 4, gpus_per_node=8, ep=4)],
    ids=lambda layout: layout.label(),
)
def test_an_ep_group_inside_one_node_is_the_same_under_either_dispatcher(layout: Layout) -> None:
    """N = 1: no IB part, (EP-1)/EP of the copies over NVLink, as the first model had it."""
    flex, alltoall = plan_costs(MOE, layout, dispatcher="flex"), plan_costs(MOE, layout)
    own = SEQ / layout.tp
    nbytes = own * 2 * 1024 * 2 * (layout.ep - 1) / layout.ep
    for costs in (flex, alltoall):
        assert costs.alltoall_parts() == pytest.approx((nbytes, 0.0))
        assert costs.alltoall_seconds() == pytest.approx(
            nbytes / H100.nvlink_bandwidth + H100.collective_latency
        )
    with pytest.raises(ValueError, match="dispatcher"):
        plan_costs(MOE, layout, dispatcher="deepep")


def test_the_all_to_all_is_in_the_op_s_duration_and_full_recompute_repeats_it() -> None:
    """With TP = CP = ETP = 1 the all-to-all is the only collective in a duration: slowing IB
    lengthens F and B by exactly their all-to-all's change. Full recomputation reruns each MoE
    layer's F, all-to-alls included, inside B."""
    layout = Layout(1, 1, 2, 8, gpus_per_node=4, ep=8)
    slow_ib = H100.perturbed({"ib_bandwidth": 0.5})
    fast, slow = plan_costs(MOE, layout), plan_costs(MOE, layout, profile=slow_ib)
    for op in (F, B):
        change = slow.expert_comm_time(op) - fast.expert_comm_time(op)
        assert change > 0 and slow.duration(op) - fast.duration(op) == pytest.approx(change)
    assert slow.duration(W) == fast.duration(W)
    full = plan_costs(MOE, layout, recompute="full")
    assert full.expert_comm_time(B) == pytest.approx(2 * fast.expert_comm_time(B))
    assert full.expert_comm_time(F) == fast.expert_comm_time(F)


def test_ep1_has_no_all_to_all() -> None:
    costs = plan_costs(MOE, Layout(1, 1, 2, 8, gpus_per_node=4))
    assert costs.alltoall_bytes() == 0.0 and costs.alltoall_seconds() == 0.0
    assert [costs.expert_comm_time(op) for op in (F, B, W)] == [0.0, 0.0, 0.0]
    assert costs.duration(F) > 0


def test_moe_flops_are_flop_costs_and_experts_cost_less_than_a_dense_mlp_of_all_of_them() -> None:
    """FLOPs are FlopCosts' MoE count; an MoE layer at EP 1 (top-2 of 16 experts of width 1024,
    as much GEMM work as one 2048-wide MLP) is quicker than the dense layer (4096-wide MLP)."""
    layout = Layout(1, 1, 2, 8)
    costs = plan_costs(MOE, layout)
    counted = FlopCosts(MOE, SEQ, 2, layers_per_stage=stage_layers(8, 2), parallel=layout.parallel)
    assert costs.flops(F) == counted.flops(F)
    assert costs.moe_layer_seconds().forward < costs.layer_seconds().forward


def test_a_dense_model_s_times_do_not_change_with_the_expert_fields() -> None:
    """A dense layout's costs are the default layout's (EP 1, ETP None), and a dense model has no
    MoE layers, no all-to-all; an MoE model's dense layers cost what the dense model's do."""
    default, explicit = Layout(2, 2, 2, 2), Layout(2, 2, 2, 2, ep=1, etp=None)
    assert default == explicit and default.parallel == dataclasses.replace(default.parallel, ep=1, etp=None)
    schedule = generate("zb-h1", 2, 4)
    first, second = plan_costs(DENSE, default, schedule), plan_costs(DENSE, explicit, schedule)
    ops = [op for ops in schedule.ranks for op in ops]
    assert [first.duration(op) for op in ops] == [second.duration(op) for op in ops]
    assert first.moe_layers == [0, 0] and all(first.expert_comm_time(op) == 0.0 for op in ops)
    mixed = dataclasses.replace(MOE, moe_layer_freq=(0,) * 4 + (1,) * 4)  # stage 0 dense, stage 1 MoE
    costs = plan_costs(mixed, Layout(1, 1, 2, 8, ep=8), schedule)
    assert costs.moe_layers == [0, 4]
    dense = plan_costs(DENSE, Layout(1, 1, 2, 8), schedule)
    for kind in (OpKind.F, OpKind.B, OpKind.W):
        assert costs.duration(Op(kind, 0, 0)) == dense.duration(Op(kind, 0, 0))


def test_layout_refuses_expert_sizes_megatron_refuses() -> None:
    with pytest.raises(ValueError, match="does not divide the 24 ranks"):
        Layout(2, 1, 2, 12, ep=16)  # EP x ETP 32 does not divide TP x CP x DP 24
    assert (
        layout_problem(Layout(1, 1, 2, 24, ep=3), MOE, SEQ, 48, 1)[0] == "expert layout"
    )  # 3 does not divide 16
    assert "16 experts" in layout_problem(Layout(1, 1, 2, 24, ep=3), MOE, SEQ, 48, 1)[1]
    assert layout_problem(Layout(1, 1, 2, 8, ep=2), DENSE, SEQ, 16, 1)[0] == "expert layout"  # dense
    assert layout_problem(Layout(2, 1, 2, 8, ep=8, etp=1), MOE, SEQ, 16, 1) is None


def test_layout_label_parallel_and_ep_group_placement() -> None:
    """EP groups are ETP x EP consecutive ranks (megatron-core's expert RankGenerator, order
    tp-cp-ep-dp-pp with tp=ETP, cp=1)."""
    layout = Layout(2, 2, 2, 4, ep=4, etp=1)
    assert layout.label() == "TP2 CP2 PP2 DP4 EP4 ETP1"
    assert Layout(2, 1, 2, 4).label() == "TP2 CP1 PP2 DP4"
    assert (layout.parallel.ep, layout.parallel.expert_tp, layout.parallel.expert_dp) == (4, 1, 4)
    assert layout.ep_intra and not Layout(2, 2, 2, 4, ep=8).ep_intra  # 4 ranks; 2 x 8 = 16 ranks
    assert Layout(8, 1, 2, 8, ep=8, etp=1).ep_intra  # EP over the TP ranks of one node


def test_pairing_hides_the_all_to_all_for_dualpipev_at_p4() -> None:
    """DualPipeV at p = 4 with EP8 over two nodes: the paired step is shorter than the unpaired
    one (each pair runs one op's all-to-all behind the other's compute)."""
    shape = dataclasses.replace(MOE, layers=16)
    spec = SCHEDULES["dualpipev"]
    schedule = generate("dualpipev", 4, max(12, spec.min_microbatches(4, spec.default_vpp, 1)))
    layout = Layout(1, 1, 4, 8, gpus_per_node=4, ep=8)
    costs = plan_costs(shape, layout, schedule)
    op = Op(OpKind.F, 0, 0)
    assert 0 < costs.expert_comm_time(op) < costs.duration(op)
    paired = pair(schedule, costs)
    assert count(paired) > 0
    assert replay(lower(paired), costs).makespan < replay(lower(schedule), costs).makespan


# ---- the search's expert layouts -----------------------------------------------------------------


def test_a_moe_shape_s_layouts_add_every_expert_layout_on_16_gpus() -> None:
    """Each TP x CP x PP x DP layout comes first, then every EP dividing the 16 experts and the
    stage's TP x CP x DP ranks with ETP = TP, and with ETP = 1 where TP > 1; every one valid."""
    base = list(layouts(16, 8))
    found = list(layouts(16, 8, MOE))
    assert {(x.tp, x.cp, x.pp, x.dp) for x in found} == {(x.tp, x.cp, x.pp, x.dp) for x in base}
    assert [x for x in found if x.ep == 1 and x.etp is None] == base  # same order
    assert {x.ep for x in found} == {1, 2, 4, 8, 16}
    assert len(set(found)) == len(found)
    for layout in found:
        assert layout.etp in (None, 1) and MOE.experts % layout.ep == 0
        assert (layout.tp * layout.cp * layout.dp) % (layout.ep * layout.expert_tp) == 0
        found_problem = layout_problem(layout, MOE, SEQ, 64, 1)
        assert found_problem is None or found_problem[0] != "expert layout", layout.label()
    valid = [x for x in found if layout_problem(x, MOE, SEQ, 64, 1) is None]
    assert {x.ep for x in valid} == {1, 2, 4, 8, 16}
    for layout in base:
        stage = layout.tp * layout.cp * layout.dp
        variants = [
            x for x in found if (x.tp, x.cp, x.pp, x.dp) == (layout.tp, layout.cp, layout.pp, layout.dp)
        ]
        expected = {(ep, None) for ep in (1, 2, 4, 8, 16) if stage % (ep * layout.tp) == 0}
        if layout.tp > 1:
            expected |= {(ep, 1) for ep in (1, 2, 4, 8, 16) if stage % ep == 0}
        assert {(x.ep, x.etp) for x in variants} == expected, layout.label()
        assert variants[0] == layout
    assert Layout(1, 1, 1, 16, ep=16) in found and Layout(2, 1, 1, 8, ep=16, etp=1) in found
    assert not any(x.ep == 16 and x.expert_tp == 2 for x in found)  # 32 ranks wider than a stage's 16


def test_expert_layouts_skip_what_megatron_refuses() -> None:
    """12 experts: EP 8 and 16 do not divide them; an expert width ETP 4 does not divide is only
    laid out at ETP 1."""
    twelve = dataclasses.replace(MOE, experts=12)
    assert {x.ep for x in layouts(16, 8, twelve)} == {1, 2, 4}
    narrow = dataclasses.replace(MOE, expert_ffn=6)  # 6 not divisible by ETP 4
    variants = list(expert_layouts(Layout(4, 1, 1, 4), narrow))
    assert variants[0] == Layout(4, 1, 1, 4)  # the plain layout always comes first
    assert all(x.etp == 1 for x in variants[1:]) and {x.ep for x in variants[1:]} == {1, 2, 4, 8, 16}


def test_a_dense_shape_s_layouts_are_unchanged() -> None:
    """A dense shape gets the TP x CP x PP x DP enumeration itself, in its order, all at EP 1."""
    for gpus in (1, 8, 16, 24):
        plain = list(layouts(gpus, 8))
        assert list(layouts(gpus, 8, DENSE)) == plain
        assert all(x.ep == 1 and x.etp is None for x in plain)
        assert list(Pins().layouts(gpus, 8, DENSE)) == list(Pins().layouts(gpus, 8))


def test_ep_and_etp_pins() -> None:
    """``Pins.ep``/``etp`` keep the expert layouts that meet them (``plan`` still refuses MoE
    models and Megatron's expert flags); a dense model or an EP not dividing the experts is
    refused before the search."""
    pinned = list(Pins(tp=2, ep=4, etp=1).layouts(16, 8, MOE))
    assert pinned and all((x.tp, x.ep, x.expert_tp) == (2, 4, 1) for x in pinned)
    assert all(x.ep == 8 and x.expert_tp == x.tp for x in Pins(ep=8, etp=2).layouts(16, 8, MOE))
    assert Pins(ep=4).pinned == ["--expert-model-parallel-size"]
    with pytest.raises(PinError, match="mixture-of-experts"):
        Pins(ep=2).check(DENSE, 16, 8)
    with pytest.raises(PinError, match="does not divide the 16 experts"):
        Pins(ep=3).check(MOE, 48, 8)
    Pins(ep=1).check(DENSE, 16, 8)
    Pins(ep=8, etp=1).check(MOE, 16, 8)
    with pytest.raises(PinError, match="at least 1"):
        Pins(ep=0)


def test_search_over_a_moe_shape_considers_expert_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search reaches the expert layouts (``plan`` itself still refuses MoE models)."""
    problem = Problem(MOE, SEQ, 16, H100, 64)
    seen: list[Layout] = []

    def spy(layout, *args):
        seen.append(layout)
        return layout_problem(layout, *args)

    monkeypatch.setattr(search_module, "layout_problem", spy)
    result = search_module.search(problem, top=3, schedules=["1f1b"], max_simulations=20)
    assert seen == list(Pins().layouts(16, 8, MOE))
    assert result.plans
