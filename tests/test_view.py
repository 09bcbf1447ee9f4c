"""The client's view of the swarm (p2p/view.py): a status reply's members, the holders of a block
(status dicts and MemberViews read alike), with no sockets."""

from blocktrain.p2p.services import Liveness, MemberView
from blocktrain.p2p.view import holders, status_members


def test_a_status_reply_and_a_peers_own_view_give_the_same_holders():
    st = {"peer_id": "b" * 64, "addr": "h:2", "blocks": [0], "role": "train",
          "members": [{"peer_id": "a" * 64, "addr": "h:1", "blocks": [0, 1], "role": "train", "state": "alive"},
                      {"peer_id": "c" * 64, "addr": "h:3", "blocks": [0], "role": "train", "state": "suspect"},
                      {"peer_id": "d" * 64, "addr": "h:4", "blocks": [0], "role": "serve", "state": "alive"}]}
    members = status_members(st)
    assert members[0] == {"peer_id": "b" * 64, "addr": "h:2", "blocks": [0], "role": "train", "state": "alive"}
    assert holders(members, 0) == ["h:1", "h:2"]  # live trainers, smallest peer id first
    assert holders(members, 0, "serve") == ["h:4"] and holders(members, 1) == ["h:1"] and not holders(members, 2)
    views = [MemberView(m["peer_id"], m["addr"], tuple(m["blocks"]), m["role"],
                        Liveness.ALIVE if m["state"] == "alive" else Liveness.SUSPECT, 0.0) for m in members]
    assert holders(views[::-1], 0) == holders(members, 0) and holders(views, 0, "serve") == ["h:4"]
