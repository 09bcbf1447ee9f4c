"""The averaging round, sans-IO: exact results, departures, rejections and every delivery order."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktrain.p2p.averaging import codec as codecs
from blocktrain.p2p.averaging import driver, robust
from blocktrain.p2p.averaging import round as round_
from blocktrain.p2p.averaging import AveragingRound, Bounds, Buffers, RoundFailed, RoundSpec

IDS = ["a", "b", "c"]


def rounds(xs, ids=IDS, **kw):
    return {p: AveragingRound(p, 0, 1, ids, x, RoundSpec(**kw)) for p, x in zip(ids, xs)}


def run(rs, order=None, drop=lambda part, src: False, queue=()):
    """Deliver every part until all rounds are done (or nothing is left to deliver)."""
    queue = list(queue) + [(p, part) for p, r in rs.items() for part in r.start()]
    order = list(order or [])
    while queue:
        src, part = queue.pop(order.pop(0) % len(queue) if order else 0)
        if drop(part, src) or part.peer not in rs:
            continue
        queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    return rs


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=200), st.integers(1, 5))
def test_any_delivery_order_gives_the_same_exact_mean_everywhere(order, pieces):
    round_.PIECE_FLOATS, old = 7, round_.PIECE_FLOATS
    try:
        torch.manual_seed(pieces)
        xs = [torch.randn(7 * pieces + 2) for _ in IDS]
        rs = run(rounds(xs), order)
        outs = [r.result()[0] for r in rs.values()]
    finally:
        round_.PIECE_FLOATS = old
    assert all(torch.equal(outs[0], o) for o in outs)  # the same bytes at every member
    assert torch.allclose(outs[0], torch.stack(xs).mean(0), atol=1e-6)


def test_a_member_departing_mid_round_leaves_the_others_finishing():
    xs = [torch.randn(100) for _ in IDS]
    rs = rounds(xs)
    queue = [(p, part) for p, r in rs.items() if p != "c" for part in r.start()]  # c never sends
    for p in ("a", "b"):
        queue += [(p, part) for part in rs[p].depart("c", "connection lost")]
    while queue:
        src, part = queue.pop(0)
        if part.peer != "c":
            queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    for p in ("a", "b"):
        out, rep = rs[p].result()
        assert rep.departed == ["c"] and rep.coverage == 1.0 and rep.why["c"] == "connection lost"
        assert torch.allclose(out, (xs[0] + xs[1]) / 2, atol=1e-6)


def test_a_departure_one_member_relays_is_its_word_the_others_wait_for_their_own_evidence():
    """Only a sees that c is gone and lists it in meta ``departed``; b does not depart c on a's word
    (r7): it waits for c's part until it sees c go itself, and then finishes without it. The claim
    stands (c's part never came): nobody is charged for it."""
    xs = [torch.randn(90) for _ in IDS]
    rs = rounds(xs, aggregate="robust")
    queue = [("a", part) for part in rs["a"].depart("c", "another view")]  # every part a sends lists c
    queue += [("b", part) for part in rs["b"].start()]
    while queue:
        src, part = queue.pop(0)
        if part.peer != "c":
            queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    assert not rs["b"].done and rs["b"].roster.claims == {"c": {"a": "departed"}}
    rs["b"].depart("c", "connection lost")
    assert rs["b"].done and rs["b"].result()[1].departed == ["c"] and not rs["b"].contradicted


def test_a_departure_claimed_of_a_member_whose_part_then_comes_is_charged_to_the_claimer():
    """a lists c as departed; c's own part comes to b after a's: b counts c in, and a's word was
    contradicted (the driver names a member whose word fails so in CLAIMS_NAMED rounds)."""
    xs = [torch.randn(90) for _ in IDS]
    rs = rounds(xs, aggregate="robust")
    queue = [("a", part) for part in rs["a"].depart("c", "forged")]  # every part a sends lists c
    queue += [(p, part) for p in ("b", "c") for part in rs[p].start()]
    while queue:
        src, part = queue.pop(0)
        queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    out, rep = rs["b"].result()
    assert rep.departed == [] and rep.coverage == 1.0 and "c" in rs["b"].gathered[0]
    assert set(rs["b"].contradicted) == {"a"} and "came after" in rs["b"].contradicted["a"]
    assert not rs["c"].contradicted  # a sends c nothing once it departed it


def test_a_poisoned_part_rejects_its_sender_and_the_round_goes_on():
    xs = [torch.randn(60) for _ in IDS]
    xs[2] = torch.full((60,), float("nan"))
    rs = run(rounds(xs))
    for p in ("a", "b"):
        out, rep = rs[p].result()
        assert [r["peer"] for r in rep.rejected] == ["c"] and "NaN" in rep.rejected[0]["reason"]
        assert torch.allclose(out, (xs[0] + xs[1]) / 2, atol=1e-6)


def test_norm_bound_and_shape_are_checked():
    xs = [torch.randn(60), torch.randn(60), torch.full((60,), 1e3)]
    rs = run(rounds(xs, bounds=Bounds(max_norm=100.0)))
    assert "exceeds the bound" in rs["a"].result()[1].rejected[0]["reason"]


def test_silence_until_the_deadline_fails_loudly_naming_who():
    xs = [torch.randn(30) for _ in IDS]
    rs = rounds(xs)
    run({p: r for p, r in rs.items() if p != "c"})
    for p in ("a", "b"):
        rs[p].expire()
        with pytest.raises(RoundFailed, match="nothing applied") as ei:
            rs[p].result()
        assert ei.value.silent == {"c"}


def test_lossy_codec_gives_the_same_bytes_everywhere():
    xs = [torch.randn(500) for _ in IDS]
    rs = run(rounds(xs, codec="int8"))
    outs = [r.result()[0] for r in rs.values()]
    assert all(torch.equal(outs[0], o) for o in outs)
    assert (outs[0] - torch.stack(xs).mean(0)).abs().max() < 0.1


def test_group_identity_covers_members_round_and_start_point():
    g = round_.group_digest
    assert g(IDS, 1, "s") == g(list(reversed(IDS)), 1, "s")
    assert len({g(IDS, 1, "s"), g(IDS, 2, "s"), g(IDS, 1, "t"), g(IDS[:2], 1, "s")}) == 4


IDS4 = ["a", "b", "c", "d"]


def test_robust_rounds_of_honest_members_are_the_plain_mean_everywhere():
    torch.manual_seed(1)
    g = torch.randn(300)
    xs = [g + 0.1 * torch.randn(300) for _ in IDS4]
    rs = run(rounds(xs, IDS4, aggregate="robust"))
    outs = [r.result()[0] for r in rs.values()]
    assert all(torch.equal(outs[0], o) for o in outs)
    assert torch.allclose(outs[0], torch.stack(xs).mean(0), atol=1e-5)
    assert rs["a"].result()[1].robust and not rs["a"].suspects


@pytest.mark.parametrize("scale", [-3.0, -8.0, 5.0])
def test_a_member_sending_a_flipped_or_scaled_update_moves_the_result_little_and_is_named(scale):
    torch.manual_seed(2)
    g = torch.randn(400)
    honest = [g + 0.2 * torch.randn(400) for _ in IDS4[:3]]
    xs = honest + [scale * g]  # within every absolute bound; sign-flipped and/or scaled
    rs = run(rounds(xs, IDS4, aggregate="robust"))
    mean_h = torch.stack(honest).mean(0)
    spread = max(float(torch.linalg.vector_norm(h - mean_h)) for h in honest)
    for p in IDS4[:3]:
        out, rep = rs[p].result()
        naive = torch.stack(xs).mean(0)
        assert float(torch.linalg.vector_norm(out - mean_h)) < 2 * spread  # bounded by the honest spread
        assert float(torch.linalg.vector_norm(naive - mean_h)) > 2 * spread  # which a plain mean is not
        assert "d" in rep.suspects


def test_a_part_far_above_the_others_is_left_out_and_its_sender_named_only_when_it_is_every_round():
    """Rule 6 (r6.23): a part whose norm is over RELATIVE_NORM x the median of its piece's parts is
    left out of that piece and its sender is a suspect of the round (``far``), no longer rejected:
    an honest member's gradient was once 107x the others' (4 x 32 byte batches, a block's first
    steps), and the rejection excluded it for good, so it trained apart. Far above the others
    every other round, a member is never named; every round, it is named after SUSPECT_ROUNDS."""
    from blocktrain.p2p.averaging.driver import SUSPECT_ROUNDS
    torch.manual_seed(3)
    xs = [torch.randn(200) for _ in IDS4[:3]] + [torch.randn(200) * 1e4]
    rs = run(rounds(xs, IDS4, aggregate="robust"))
    outs = []
    for p in IDS4:  # "d" too leaves its own part out: every member ends with the same bytes
        out, rep = rs[p].result()
        assert not rep.rejected and rep.coverage == 1.0 and set(rep.far) == {"d"} and rep.far["d"] > 100
        assert torch.allclose(out, torch.stack(xs[:3]).mean(0), atol=1e-5)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])

    def spikes(every):
        return lambda rnd: [torch.randn(200) for _ in IDS4[:3]] + [torch.randn(200) * (1e4 if rnd % every == 0 else 1)]
    assert _named_over_rounds(spikes(2), IDS4, 12, window=False, codec="raw") == {}
    assert _named_over_rounds(spikes(1), IDS4, 12, window=False, codec="raw") == {"d": SUSPECT_ROUNDS}


def test_in_a_robust_round_nobody_can_substitute_an_average():
    """The attack on reduce-scatter: an owner sends its own 'average'. Here there are no owners:
    an average sent at all rejects its sender, and the others' results are their own."""
    from blocktrain.p2p.tensors import to_wire
    from blocktrain.protocol import BlockUpdate
    xs = [torch.randn(100) for _ in IDS4]
    rs = rounds(xs, IDS4, aggregate="robust")
    forged = BlockUpdate(block=0, round=1, tensors=(to_wire("part", torch.full((100,), 9.0)),),
                         meta={"phase": "gather", "part": 0, "group": rs["a"].group, "contributors": IDS4})
    queue = [(p, part) for p in ("a", "b", "c") for part in rs[p].receive("d", forged)]
    run({p: rs[p] for p in ("a", "b", "c")}, queue=queue)
    for p in ("a", "b", "c"):
        out, rep = rs[p].result()
        assert [r["peer"] for r in rep.rejected] == ["d"]
        assert torch.allclose(out, torch.stack(xs[:3]).mean(0), atol=1e-5)


def test_two_members_cannot_be_robust_and_say_so():
    rs = run(rounds([torch.randn(50), torch.randn(50)], ["a", "b"], aggregate="robust"))
    assert not rs["a"].result()[1].robust


def test_a_piece_whose_average_came_is_not_averaged_again_when_its_owner_departs():
    """c sends its average of the piece it owns to a and b, then departs: the piece moves to a live
    member, which must not average it again over c's (b has it already and would not take a second
    one): a and b end with the same bytes, c's average of that piece."""
    xs = [torch.randn(30) for _ in IDS]
    rs = rounds(xs)
    queue = [(p, part) for p, r in rs.items() for part in r.start()]
    held, late = [], []  # c's averages; a's and b's averages (still on their way when c departs)
    while queue:
        src, part = queue.pop(0)
        if part.msg.meta["phase"] == "gather" and part.peer != "c":
            (held if src == "c" else late).append((src, part))
            continue
        if part.peer != "c" or not held:
            queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    for src, part in held:  # c's average reaches a and b; then c is gone for both
        queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    assert not rs["a"].done and not rs["b"].done
    for p in ("a", "b"):
        queue += [(p, q) for q in rs[p].depart("c", "connection lost")]
    queue += late
    while queue:
        src, part = queue.pop(0)
        if part.peer != "c":
            queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    assert rs["a"].done and rs["b"].done
    (oa, _), (ob, _) = rs["a"].result(), rs["b"].result()
    assert torch.equal(oa, ob)
    c_piece = [j for j in range(rs["a"].P) if IDS[j % 3] == "c"]
    a0, b0 = rs["a"].bounds_[c_piece[0]], rs["a"].bounds_[c_piece[0] + 1]
    assert torch.allclose(oa[a0:b0], torch.stack(xs).mean(0)[a0:b0], atol=1e-6)  # c's average, of all three


def test_a_part_that_does_not_decode_rejects_its_sender():
    """Bad lz4 bytes in a member's part are that member's fault: it is rejected and named, the
    round goes on (they were taken for a bug of ours and failed every round)."""
    import dataclasses

    from blocktrain.protocol.tensors import pack_tensor
    xs = [torch.zeros(4000) for _ in IDS]
    rs = rounds(xs[:2], ids=IDS)
    part = rs["a"].start()[0]
    w = pack_tensor("part", "float32", (part.msg.tensors[0].numel,), bytes(4 * part.msg.tensors[0].numel),
                    compress="always")
    assert any(w.lz4)
    bad = dataclasses.replace(w, segments=tuple(b"\xff" * len(s) for s in w.segments))
    msg = dataclasses.replace(part.msg, tensors=(bad,))
    rs["b"].receive("a", msg)
    assert [r["peer"] for r in rs["b"].rejected] == ["a"] and "does not decode" in rs["b"].rejected[0]["reason"]


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_lent_lossy_buffers_give_the_bytes_of_fresh_ones_round_after_round(codec):
    """Error feedback in the driver's buffers (lent every round, the residual written in place)
    equals the same rounds with fresh tensors; a non-finite int8 input raises before the lent
    residual is touched."""
    scratch = {p: codecs.lossy_scratch(5000, codec) for p in IDS[:2]}
    res_lent, res_fresh = {p: None for p in IDS[:2]}, {p: None for p in IDS[:2]}
    for rnd in range(1, 5):
        xs = [torch.randn(5000) * rnd for _ in IDS[:2]]
        lent = run({p: AveragingRound(p, 0, rnd, IDS[:2], x, RoundSpec(codec=codec), residual=res_lent[p],
                                      lent=Buffers(scratch=scratch[p]))
                    for p, x in zip(IDS[:2], xs)})
        fresh = run({p: AveragingRound(p, 0, rnd, IDS[:2], x, RoundSpec(codec=codec), residual=res_fresh[p])
                     for p, x in zip(IDS[:2], xs)})
        for p in IDS[:2]:
            assert torch.equal(lent[p].result()[0], fresh[p].result()[0])
            assert torch.equal(lent[p].residual, fresh[p].residual)
            assert lent[p].residual.data_ptr() == scratch[p]["residual"].data_ptr()
            res_lent[p], res_fresh[p] = lent[p].residual, fresh[p].residual
    if codec == "int8":
        before = scratch["a"]["residual"].clone()
        x = torch.randn(5000)
        x[-1] = float("nan")  # in the last piece: the first would be encoded before it is met
        with pytest.raises(ValueError, match="non-finite"):
            AveragingRound("a", 0, 9, IDS[:2], x, RoundSpec(codec=codec), residual=res_lent["a"],
                           lent=Buffers(scratch=scratch["a"]))
        assert torch.equal(scratch["a"]["residual"], before)


def _centred_clip_as_written(x, suspects, ids):
    """PROTOCOL.md 7.1's centred clipping, written as plainly as it reads (fresh tensors, torch.median)."""
    v = x.median(dim=0).values
    dist = torch.linalg.vector_norm(x - v, dim=1)
    scale = float(dist.median())
    if scale == 0.0:
        return x.mean(0)
    for i, p in enumerate(ids):
        if float(dist[i]) / scale > robust.SUSPECT_RADIUS:
            suspects[p] = max(suspects.get(p, 0.0), round(float(dist[i]) / scale, 2))
    tau = robust.CLIP_RADIUS * scale
    for _ in range(robust.CLIP_ITERS):
        d = x - v
        n = torch.linalg.vector_norm(d, dim=1, keepdim=True).clamp_min(1e-30)
        v = v + (d * torch.clamp(tau / n, max=1.0)).mean(0)
    return v


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 12), st.integers(1, 3000), st.integers(0, 2**31 - 1), st.sampled_from(["normal", "ties", "outlier"]))
def test_the_fast_median_and_clipping_give_the_bytes_of_the_protocols_arithmetic(rows, n, seed, kind):
    """Members of one round must end with the same values, whatever version of this code each
    runs: the sorting-network median and the in-place clipping equal torch.median and fresh
    tensors (even row counts: the lower median), ties, zeros of both signs and an outlier included.
    (torch.equal takes -0.0 for 0.0: which zero a median of equal zeros returns is not specified.)"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if kind == "ties":
        x = torch.randint(-2, 3, (rows, n), generator=g).float() * (torch.rand(rows, n, generator=g) < 0.5).float().mul(-2).add(1)
    elif kind == "outlier":
        x[0] *= 1e4
    assert torch.equal(robust.coordinate_median(x), x.median(dim=0).values)
    if rows >= 3:
        ids = [f"m{i}" for i in range(rows)]
        s_fast, s_plain = {}, {}
        before = x.clone()
        assert torch.equal(robust.centred_clip(x, s_fast, ids), _centred_clip_as_written(x, s_plain, ids))
        assert s_fast == s_plain and torch.equal(x, before)  # the parts are not written to


@pytest.mark.parametrize("signal", [1.5, 2.0])
def test_a_sign_flipped_on_the_wire_is_named_though_its_distance_is_an_honest_ones(signal):
    """A member that flips the sign of what it sends (and averages honestly
    itself) sits as far from the median as honest noise, so the distance rule never named it.
    Its update points against the median: the round reports it as opposed; honest ones never are
    (each is part of the median). The limit: it is seen once the members' common direction is
    about as large as their noise (here its per-coordinate spread is 0.75 and 1 of the noise's;
    at 0.5 the flipped update still has a cosine of +0.28 with the median and is not named)."""
    torch.manual_seed(3)
    n = 20_000
    g = signal * torch.randn(n) / 2  # the members' common direction, against unit noise per coordinate
    honest = [g + torch.randn(n) for _ in IDS4[:3]]
    flipped = -(g + torch.randn(n))
    rs = run(rounds(honest + [flipped], IDS4, aggregate="robust"))
    for p in IDS4[:3]:
        rep = rs[p].result()[1]
        assert "d" in rep.opposed and rep.opposed["d"] < -robust.OPPOSED_COS
        assert set(rep.opposed) == {"d"}
    weak = 0.5 * torch.randn(n) / 2  # the stated limit: a direction a quarter of the noise hides the flip
    rs = run(rounds([weak + torch.randn(n) for _ in IDS4[:3]] + [-(weak + torch.randn(n))], IDS4, aggregate="robust"))
    assert not rs["a"].result()[1].opposed
    noise = run(rounds([torch.randn(n) for _ in IDS4], IDS4, aggregate="robust"))  # no common direction at all
    assert all(not r.result()[1].opposed for r in noise.values())


def _named_over_rounds(make, ids, rounds_, window=True, codec="sign"):
    """Robust rounds 1..rounds_ of ``make(rnd)`` (the members' vectors, sign-coded: the pair window
    judges sign rounds only) judged by the first member as the driver does (rule 6,
    ``outliers_in_a_row``): member -> the round it was named in."""
    from blocktrain.p2p.averaging.driver import outliers_in_a_row
    streak, win, named = {}, robust.PairWindow() if window else None, {}
    for rnd in range(1, rounds_ + 1):
        spec = RoundSpec(aggregate="robust", codec=codec)
        rs = {p: AveragingRound(p, 0, rnd, ids, x, spec) for p, x in zip(ids, make(rnd))}
        run(rs)
        for pid, _ in outliers_in_a_row(rs[ids[0]], ids[0], streak, win):
            named.setdefault(pid, rnd)
    return named


def test_a_sign_flipped_once_the_updates_are_noisy_is_named_by_the_pair_window():
    """The late sign flipper (r6.20): in sign rounds where the members' common
    direction is half the noise per coordinate, the flipped update still agrees with the median
    (+0.19) and the median test never names it; against each honest member's update it points
    away (-0.13, the honest ones agreeing at +0.13), and over the window of rounds that is
    clear: named after the window fills and SUSPECT_ROUNDS rounds in a row. Honest members never
    are. Where the common direction is weak (a quarter of the noise: honest cosines +0.04), the
    others do not agree clearly enough (PAIR_AGREE) and nobody is named; nor in rounds that are
    not sign-coded (per-step gradients)."""
    n = 20_000

    def flipped(spread):
        def make(rnd):
            g = spread * torch.randn(n)
            return [g + torch.randn(n) for _ in IDS4[:3]] + [-(g + torch.randn(n))]
        return make
    torch.manual_seed(3)
    assert _named_over_rounds(flipped(0.5), IDS4, 12, window=False) == {}  # the median alone misses it
    torch.manual_seed(3)
    assert _named_over_rounds(flipped(0.5), IDS4, 12) == {"d": robust.PAIR_MIN_ROUNDS + driver.SUSPECT_ROUNDS - 1}
    torch.manual_seed(3)
    assert _named_over_rounds(flipped(0.25), IDS4, 12) == {}
    torch.manual_seed(3)
    assert _named_over_rounds(flipped(0.5), IDS4, 12, codec="raw") == {}


@pytest.mark.parametrize("kind", ["no common direction", "each against the mean"])
def test_honest_members_whose_updates_point_apart_are_never_named_by_the_pair_window(kind):
    """Honest updates with no common direction (cosines about 0, noisy), or each member's data
    apart from the mean (deviations that sum to zero: every pair's cosine about -1/3 with 4
    members, the case of per-step gradients of a deeper block where the common direction is weak):
    no member is singled out, since the others do not agree among themselves either."""
    torch.manual_seed(8)
    n = 20_000

    def apart(rnd):
        d = [torch.randn(n) for _ in IDS4]
        if kind == "no common direction":
            return d
        mean = sum(d) / 4
        return [x - mean + 0.05 * torch.randn(n) for x in d]
    assert _named_over_rounds(apart, IDS4, 20) == {}


@pytest.mark.parametrize("members", [3, 4])
@pytest.mark.parametrize("attack", ["reverse", "copy"])
def test_an_attacker_cannot_make_an_honest_members_updates_look_opposed(members, attack):
    """The pair test takes the upper median of a member's cosines with the others, and asks the
    others to agree among themselves. An attacker that answers last and sends exactly the reverse
    of one honest member's update every round (the worst it can do to that member's cosines)
    lowers one of them, not the figure where honest members are the majority of the others, and
    with 3 members its own disagreement leaves no agreement to judge against; it is named itself
    (against the median too). One that copies another honest
    member's update raises the others' agreement, but an honest member's figure stays at its
    lowest cosine with an honest member, positive where honest updates share a direction. The
    victim is judged by another honest member. The limit (PROTOCOL 7.1): where two honest
    members' updates point apart by more than half the others' agreement, the copy gets one named."""
    torch.manual_seed(11)
    n, ids = 20_000, IDS4[:members]

    def steer(rnd):
        g = 0.5 * torch.randn(n)
        honest = [g + torch.randn(n) for _ in ids[:-1]]
        return honest + [-honest[1] if attack == "reverse" else honest[-1].clone()]
    named = _named_over_rounds(steer, ids, 15)  # judged by "a"; the victim is "b"
    assert set(named) == ({ids[-1]} if attack == "reverse" else set())


def test_the_pair_window_keeps_only_the_latest_rounds_members_and_counts_a_pair_once_it_has_rounds():
    """Bounded: pairs with a member not in the latest round go (identities are free); a pair counts
    only once it holds PAIR_MIN_ROUNDS rounds (a new member is judged on more than one round)."""
    w = robust.PairWindow()
    w.add({("a", "b"): [1.0, 1.0, 1.0], ("a", "x"): [-1.0, 1.0, 1.0], ("b", "x"): [-1.0, 1.0, 1.0]}, ["a", "b", "x"])
    assert len(w.acc) == 3 and w.opposed({"a", "b", "x"}, "a") == {}  # one round: not yet
    for _ in range(robust.PAIR_MIN_ROUNDS):
        w.add({("a", "b"): [1.0, 1.0, 1.0], ("a", "x"): [-1.0, 1.0, 1.0], ("b", "x"): [-1.0, 1.0, 1.0]},
              ["a", "b", "x"])
    assert w.opposed({"a", "b", "x"}, "a") == {"x": -1.0}
    w.add({("a", "b"): [1.0, 1.0, 1.0]}, ["a", "b", "y"])
    assert set(w.acc) == {("a", "b")}


def test_the_pair_and_median_sums_do_not_depend_on_the_order_parts_came_in():
    """A member rejected after some pieces counted it has those pieces computed again; their sums
    (the pairs, the cosines with the median, the suspects' distances) replace the first ones
    instead of adding to them, so every member ends with the same sums whatever order its parts
    came in (before, the pieces a
    member had gathered before the rejection counted twice, and members could name differently
    from the same parts)."""
    round_.PIECE_FLOATS, old = 7, round_.PIECE_FLOATS
    try:
        torch.manual_seed(6)
        xs = [torch.randn(28) for _ in IDS4[:3]] + [torch.cat([torch.randn(21), 1e5 * torch.randn(7)])]
        sums = []
        for order in ([], [10 ** 6] * 400, [7, 3, 11] * 150):
            rs = run(rounds(xs, IDS4, aggregate="robust", codec="sign", bounds=Bounds(max_norm=1e4)), order)
            for p in IDS4[:3]:
                r = rs[p]
                assert any(x["peer"] == "d" for x in r.rejected)  # its last piece is over the norm bound
                sums.append((r.pairs, r._agree, r.suspects, r.far))
        assert all(x == sums[0] for x in sums[1:])
    finally:
        round_.PIECE_FLOATS = old


def test_a_pair_cosine_counts_only_the_pieces_that_held_both_parts():
    """A part that missed a piece leaves that piece out of its pairs instead of counting as zeros
    there, which would shrink its cosines toward 0 (a late part must not make an honest member
    look opposed, nor hide a reversed one)."""
    torch.manual_seed(2)
    rows = torch.randn(3, 50)
    whole, cut = {}, {}
    robust.accumulate_pairs(whole, rows[:, :25], ["a", "b", "c"])
    robust.accumulate_pairs(cut, rows[:, :25], ["a", "b", "c"])
    robust.accumulate_pairs(cut, rows[:2, 25:], ["a", "b"])  # c's part of the second piece missed it
    assert robust.pair_cosines(cut, {"a", "b", "c"})["c"] == robust.pair_cosines(whole, {"a", "b", "c"})["c"]
    assert cut[("a", "b")] != whole[("a", "b")]
    assert set(robust.pair_cosines(cut, {"a", "b"})) == {"a", "b"}  # a member not live is left out


def test_a_gossip_partner_that_reverses_its_update_is_opposed_measured_from_our_start():
    """Gossip's attack target (one malicious member of 16, named): in a gossip round the parts are parameters and
    the partners' start points differ (by the consensus distance: 0.5 of an update's norm at the
    median in the simulator), so every part's cosine with the median is about 1 and a reversed
    update (start - update) was never opposed. Measured from our own start point (``origin``),
    the reversed update points against the median's and honest ones agree with it. The limit:
    with start points an update's norm apart, the offsets to the group's centre that every
    partner shares hide the reversal. The aggregate's bytes do not depend on ``origin``."""
    torch.manual_seed(5)
    n = 20_000
    base, g = 3 * torch.randn(n), torch.randn(n)  # a common point; the members' common direction
    moved = {p: g + torch.randn(n) for p in IDS4}  # each member's update: the direction and unit noise
    offsets = {p: torch.randn(n) for p in IDS4}

    def gossip_round(apart: float, origin: bool):
        starts = {p: base + apart * offsets[p] for p in IDS4}  # each member's own start point
        xs = {p: starts[p] + moved[p] for p in IDS4[:3]} | {"d": starts["d"] - moved["d"]}
        return run({p: AveragingRound(p, 0, 1, IDS4, xs[p], RoundSpec(aggregate="robust"),
                                      origin=starts[p] if origin else None) for p in IDS4})
    measured, plain = gossip_round(0.5, True), gossip_round(0.5, False)  # start points 0.5 updates apart
    for p in IDS4[:3]:
        out, rep = measured[p].result()
        assert set(rep.opposed) == {"d"} and rep.opposed["d"] < -robust.OPPOSED_COS
        assert not plain[p].result()[1].opposed  # points: all alike to the cosine
        assert torch.equal(out, plain[p].result()[0])
    far = gossip_round(1.0, True)  # the stated limit
    assert not any(far[p].result()[1].opposed for p in IDS4[:3])
    with pytest.raises(ValueError, match="origin"):
        AveragingRound("a", 0, 1, IDS4, base, RoundSpec(aggregate="robust"), origin=torch.zeros(n - 1))


def test_a_mismatch_is_seen_by_each_member_itself_and_a_forged_one_is_charged_to_its_sender():
    """Rule 4 / driver rule 9, r7: b lists c in meta ``mismatched``. Where c's own part comes with
    a's view, a neither departs c nor counts it mismatched (the round is not failed on b's word),
    and b's word is contradicted. Where c did begin the round with another view, a sees that itself (c's parts carry
    another group): the mismatch is a's own."""
    torch.manual_seed(0)
    rs = rounds([torch.randn(50) for _ in IDS], aggregate="robust")
    first = [("b", q) for q in rs["b"].mismatch("c", "forged")]  # every part b sends lists c
    run({p: rs[p] for p in ("a", "c")}, queue=first)
    assert rs["a"].done and rs["a"].mismatched == set() and rs["a"].departed == {}
    assert set(rs["a"].contradicted) == {"b"} and not rs["c"].contradicted  # b sends c nothing now
    other = rounds([torch.randn(50) for _ in IDS], aggregate="robust")
    run({p: other[p] for p in ("a", "b")}, queue=[("a", q) for q in other["a"].mismatch("c", "sees another group")]
        + [("b", q) for q in other["b"].mismatch("c", "sees another group")])
    for p in ("a", "b"):
        assert other[p].done and other[p].mismatched == {"c"} and not other[p].contradicted


def test_the_suspect_streaks_kept_are_bounded_in_total_and_a_named_members_is_dropped():
    """Rule 6's per-member count: members that leave as suspects (identities are free) are kept at
    most MAX_NAMED in all, the least recently counted going first; a member named is forgotten,
    so one that comes back after the named list forgot it is judged again from nothing."""
    from types import SimpleNamespace

    from blocktrain.p2p.averaging.driver import MAX_NAMED, SUSPECT_ROUNDS, outliers_in_a_row

    def rnd(i, live, suspects):
        return SimpleNamespace(robust=True, round=i, suspects={p: 9.0 for p in suspects}, live=lambda: live,
                               opposed=lambda: {}, far={})
    streak: dict = {}
    for i in range(3 * MAX_NAMED):  # a fresh suspect every round, each gone the next
        outliers_in_a_row(rnd(i, ["me", "h", f"x{i}"], [f"x{i}"]), "me", streak)
        assert len(streak) <= MAX_NAMED
    named = [outliers_in_a_row(rnd(i, ["me", "h", "x"], ["x"]), "me", streak) for i in range(SUSPECT_ROUNDS)]
    assert [p for p, _ in named[-1]] == ["x"] and not any(named[:-1]) and "x" not in streak


def test_a_malformed_mismatched_list_rejects_its_sender():
    rs = rounds([torch.randn(50) for _ in IDS])
    parts = rs["b"].start()
    part = next(q for q in parts if q.peer == "a")
    part.msg.meta["mismatched"] = "c"  # not a list
    rs["a"].receive("b", part.msg)
    assert rs["a"].rejected_ids() == {"b"}


@pytest.mark.parametrize("codec", ["int8", "sign"])
def test_a_failed_round_gives_back_the_error_feedback_it_started_with(codec):
    """Nothing of a failed round is applied, so its rounding error is not carried to the next one:
    the residual is what it was before the round (to float32 rounding)."""
    torch.manual_seed(1)
    before = torch.randn(300) * 0.01
    r = AveragingRound("a", 0, 1, IDS, torch.randn(300), RoundSpec(codec=codec, min_coverage=1.0),
                       residual=before.clone())
    r.start()
    assert not torch.allclose(r.residual, before)  # the encoding wrote this round's error
    r.expire()
    with pytest.raises(RoundFailed):
        r.result()
    r.undo_feedback()
    assert torch.allclose(r.residual, before, atol=1e-6)


def test_the_members_a_round_departs_as_it_begins_are_those_that_left_since_it_was_fixed():
    """Rounds._gone (r6.19): of a round's members, fixed before its local steps, those that left
    the group meanwhile by a LEAVE or a Goodbye or death (Membership.left) depart it as it begins;
    not one a round departed (it may still send its parts), nor one back in the group; and only
    while the group's round is the round's (it is taken when the round is sent)."""
    from types import SimpleNamespace

    from blocktrain.p2p.group import Group, State
    from blocktrain.p2p.swarm import SwarmConfig
    from blocktrain.p2p.swarm.rounds import Rounds
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 9, {"b": 1, "c": 1, "d": 1}
    membership = SimpleNamespace(left={})
    rounds = Rounds(SimpleNamespace(id="a"), g, None, membership, SwarmConfig(), None, None, None)
    members = g.begin_round(10, "x", 0)
    assert members == ["a", "b", "c", "d"]
    g.depart("c", "left")
    membership.left["c"] = "left the group (left)"  # what Membership records for a Goodbye
    g.depart("d", "unreachable: reset")  # a round departed it: not in ``left``
    assert rounds._gone(10, members) == {"c": "left the group (left)"}
    g.begin_round(11, "y", 0)
    assert rounds._gone(10, members) == {}  # the next round began: not this group's round any more
    g.joined["c"] = 11  # admitted again: in the group from round 11 (Membership forgets it left: test_hardening)
    assert rounds._gone(11, ["a", "b", "c"]) == {}
