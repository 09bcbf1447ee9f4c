"""Serving: a chain of peers, each computing its blocks' share of a traversal, and the clients
that drive it (Petals keeps its server and client apart the same way).

Server side: ``server`` (a hop: sessions, compute, forwarding), ``hop`` (the sans-IO plan of one
request at one hop), ``batching`` (continuous batching on the hop's compute thread), ``fair``
(fair queuing of clients for the compute slots). Client side: ``client`` (building chains,
driving sessions), ``verify`` (checking an output on other holders). Both sides: ``api`` (the
request's vocabulary: modes, meta keys, codecs, typed failures). The client side imports no
server module (tests/test_layers.py).
"""
