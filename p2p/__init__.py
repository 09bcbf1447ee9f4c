"""blocktrain.p2p: the asyncio runtime over the sans-IO protocol, and the torch tensor adapter."""
