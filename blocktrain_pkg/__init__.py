"""BlockTrain: decentralised block-local training and serving over plain TCP.

Subpackages: ``blocktrain.protocol`` (sans-IO wire protocol), ``blocktrain.blocks`` (PyTorch
model, data, training), ``blocktrain.bench`` (``bt-bench``).
"""

__version__ = "0.1.0"
