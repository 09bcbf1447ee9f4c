"""blocktrain.protocol: the sans-IO BlockTrain wire protocol (see PROTOCOL.md).

Bytes in, events out. No sockets, no asyncio, no torch.
"""

from .connection import (MAX_HANDSHAKE_FRAME_BYTES, MAX_HELLO_BYTES, NEED_DATA, TRANSITIONS, ByteCounter, Connection,
                         ConnectionClosed, HandshakeComplete, Role, State, check_info)
from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .events import (MESSAGES, Announce, BlockUpdate, Error, Goodbye, Handshake, Message, PeerInfo, PeerList,
                     PipelineForward, PipelineResult, Ping, Pong, Status, StreamChunk, StreamEnd, StreamOpen,
                     StreamRequest, StreamReset, SIGN_BYTES, TOPK_CHUNK_ELEMS, decode_payload, encode_payload,
                     unpack_canonical)
from .frames import HEADER_BYTES, MAX_FRAME_BYTES, PROTOCOL_VERSION, Flags, FrameBuffer, MessageType
from .handshake import HandshakeError, NoiseHandshake, peer_id_of
from .streams import CHUNK_SIZE_BYTES, StreamFailed, StreamReceiver, stream_messages
from .tensors import SEGMENT_ELEMS, Codec, WireTensor, pack_tensor

__all__ = [
    "MAX_HANDSHAKE_FRAME_BYTES", "MAX_HELLO_BYTES", "NEED_DATA", "TRANSITIONS", "ByteCounter", "Connection",
    "ConnectionClosed", "HandshakeComplete", "Role", "State", "check_info",
    "ErrorCode", "LocalProtocolError", "ProtocolError", "RemoteProtocolError",
    "MESSAGES", "Announce", "BlockUpdate", "Error", "Goodbye", "Handshake", "Message", "PeerInfo", "PeerList",
    "PipelineForward", "PipelineResult", "Ping", "Pong", "Status", "StreamChunk", "StreamEnd", "StreamOpen",
    "SIGN_BYTES", "StreamRequest", "StreamReset", "TOPK_CHUNK_ELEMS", "decode_payload", "encode_payload", "unpack_canonical",
    "HEADER_BYTES", "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "Flags", "FrameBuffer", "MessageType",
    "HandshakeError", "NoiseHandshake", "peer_id_of",
    "CHUNK_SIZE_BYTES", "StreamFailed", "StreamReceiver", "stream_messages",
    "SEGMENT_ELEMS", "Codec", "WireTensor", "pack_tensor",
]
