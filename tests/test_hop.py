"""The plan of one hop (p2p/serving/hop.py), with no sockets: a request and a hop's state in, a plan out;
every check in its order, each refusal with its fault."""

from dataclasses import dataclass, field

from blocktrain.blocks.decode import one_traversal_spec
from blocktrain.blocks.model import Block, ModelConfig
from blocktrain.p2p.serving.hop import MAX_INFLIGHT_PER_CLIENT, Step, plan_hop, session_key
from blocktrain.p2p.serving.api import PipelineError, refusal_meta
from blocktrain.protocol import PipelineForward

CFG = ModelConfig(d_model=16, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64, head_layers=1)
BLOCKS = {k: Block(CFG, k) for k in range(3)}
ROUTE = ("10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:3")
CLIENT, MEMBER, STRANGER = "c" * 64, "m" * 64, "s" * 64


@dataclass
class Hop:
    """A hop's state as the plan reads it (hop.HopState)."""
    block: int
    addr: str = "10.0.0.9:9"
    reference: bool = True  # it also serves the end-to-end reference
    members: set = field(default_factory=lambda: {MEMBER})
    serving: dict = field(default_factory=lambda: {k: {ROUTE[k]} for k in range(3)})  # block -> live addrs
    inflight: dict = field(default_factory=dict)
    busy: set = field(default_factory=set)

    def held(self, mode):
        return {self.block: BLOCKS[self.block]} if mode != "reference" or self.reference else {}

    def is_member(self, peer_id):
        return peer_id in self.members

    def serves(self, addr, block):
        return addr in self.serving.get(block, ())

    def in_flight(self, client):
        return self.inflight.get(client, 0)

    def is_busy(self, key):
        return key in self.busy


def request(at=0, route=ROUTE, **meta):
    """A request at hop ``at``: a good one, but for ``meta``."""
    base = {"mode": "exact", "blocks": [0, 1, 2], "reply_to": CLIENT, "session": 7,
            "spec": one_traversal_spec(b"hi", 3), "junk": "dropped"}
    return PipelineForward(request_id=1, route=route, hop=at, meta={**base, **meta})


def refused(plan, match, fault="hop", block=0, hop=0):
    assert plan.step is Step.REFUSE and isinstance(plan.error, PipelineError), plan
    assert plan.error.fault == fault and plan.error.block == block and plan.error.hop == hop, vars(plan.error)
    assert match in str(plan.error)


def test_a_good_request_is_computed_and_passed_on_with_the_forwarded_keys_only():
    plan = plan_hop(request(), CLIENT, Hop(0))
    assert plan.step is Step.COMPUTE and plan.error is None and plan.served is BLOCKS[0] and not plan.last
    assert plan.key == session_key(CLIENT, plan.meta, 0) == (CLIENT, 7, False, 0)
    assert "junk" not in plan.meta and plan.spec["ids"] == list(b"hi") + [256, 256]
    last = plan_hop(request(at=2), MEMBER, Hop(2))  # later hops: reply_to from the member below
    assert last.step is Step.COMPUTE and last.last and last.client == CLIENT and last.key == (CLIENT, 7, False, 2)
    ref = plan_hop(request(mode="reference"), CLIENT, Hop(0))
    assert ref.key == (CLIENT, 7, True, 0)


def test_where_the_client_connects_from_is_hop_0s_word_not_the_clients():
    """r12: ``client_addr`` a client sends is dropped at hop 0 (which sets its own from the
    client's connection); a later hop reads the one the member below passed on."""
    assert "client_addr" not in plan_hop(request(client_addr="10.9.9.9"), CLIENT, Hop(0)).meta
    assert plan_hop(request(at=1, client_addr="10.9.9.9"), MEMBER, Hop(1)).meta["client_addr"] == "10.9.9.9"


def test_the_request_fields_are_checked_first_and_are_the_requests_fault():
    refused(plan_hop(request(mode="fast"), CLIENT, Hop(0)), "unknown mode 'fast'", "request")
    refused(plan_hop(request(session="7"), CLIENT, Hop(0)), "session (an int)", "request")
    refused(plan_hop(request(at=1, reply_to=5), MEMBER, Hop(1)), "reply_to (a peer id)", "request", 1, 1)
    refused(plan_hop(request(codec="gzip"), CLIENT, Hop(0)), "codec must be one of", "request")
    # none of them reached a served block: the run does not expire sessions for them
    assert plan_hop(request(codec="gzip"), CLIENT, Hop(0)).served is None


def test_the_route_who_may_send_and_where_it_goes():
    refused(plan_hop(request(reply_to=STRANGER), CLIENT, Hop(0)), "sender's own peer id", "request")
    refused(plan_hop(request(at=1), STRANGER, Hop(1)), "only a member forwards", "request", 1, 1)
    refused(plan_hop(request(at=1), MEMBER, Hop(0)), "does not serve block 1", "hop", 1, 1)
    refused(plan_hop(request(mode="reference"), CLIENT, Hop(0, reference=False)), "without --reference DIR")
    refused(plan_hop(request(route=ROUTE[:2]), CLIENT, Hop(0)), "one hop per block 0..2", "request")
    refused(plan_hop(request(blocks=[0, 2, 1]), CLIENT, Hop(0)), "one hop per block 0..2", "request")
    gone = Hop(0, serving={1: set()})  # the next hop is checked before any compute, and blamed
    refused(plan_hop(request(), CLIENT, gone), f"hop {ROUTE[1]} is not a live member serving block 1", "hop", 1, 1)


def test_after_the_route_a_spec_or_an_end_then_the_hops_limits():
    end = plan_hop(request(spec=None, end=True), CLIENT, Hop(0))
    assert end.step is Step.END and end.key == (CLIENT, 7, False, 0) and not end.last
    assert plan_hop(request(at=2, spec=None, end=True), MEMBER, Hop(2)).last
    plan = plan_hop(request(spec=None), CLIENT, Hop(0))
    refused(plan, "needs a spec (or end", "request")
    assert plan.served is BLOCKS[0]  # past the route check: the run expires idle sessions first
    refused(plan_hop(request(spec={"ids": "x"}), CLIENT, Hop(0)), "bad spec", "request")
    long = one_traversal_spec(b"x" * 60, 10)  # past the model's 64 positions
    refused(plan_hop(request(spec=long), CLIENT, Hop(0)), "bad spec", "request")
    full = Hop(0, inflight={CLIENT: MAX_INFLIGHT_PER_CLIENT})
    refused(plan_hop(request(), CLIENT, full), f"more than {MAX_INFLIGHT_PER_CLIENT} requests", "request")
    assert plan_hop(request(), CLIENT, Hop(0, inflight={STRANGER: 99})).step is Step.COMPUTE  # per client
    busy = Hop(0, busy={(CLIENT, 7, False, 0)})
    refused(plan_hop(request(), CLIENT, busy), "previous traversal is still running", "session")
    assert plan_hop(request(session=8), CLIENT, busy).step is Step.COMPUTE  # per session


def test_a_relayed_error_reaches_the_client_only_from_a_member_at_the_last_hop():
    err = {"error": "boom", "hop": 1, "block": 1, "fault": "hop"}
    relay = plan_hop(request(at=2, **err), MEMBER, Hop(2))
    assert relay.step is Step.RELAY and relay.client == CLIENT and relay.meta["error"] == "boom"
    assert plan_hop(request(at=2, **err), STRANGER, Hop(2)).step is Step.IGNORE  # not a member
    assert plan_hop(request(at=1, **err), MEMBER, Hop(1)).step is Step.IGNORE  # not the last hop
    assert plan_hop(request(at=2, reply_to=5, **err), MEMBER, Hop(2)).step is Step.IGNORE  # no client


def test_an_unexpected_failure_in_a_check_is_a_refusal_too():
    class Broken(Hop):
        def is_busy(self, key):
            raise RuntimeError("state gone")
    plan = plan_hop(request(), CLIENT, Broken(0))
    assert plan.step is Step.REFUSE and isinstance(plan.error, RuntimeError) and plan.key is None
    assert refusal_meta(plan.error, plan.block, 0) == {"error": "RuntimeError: state gone", "hop": 0, "block": 0,
                                                       "fault": "hop"}
