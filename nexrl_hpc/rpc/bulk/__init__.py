"""Signed bulk messages: a dict of tensors plus a small header, streamed in verified chunks.

``format`` holds the wire format, the per-message key schedule and the Poly1305 tags; ``sender``
the ``BulkSender`` (one per sending thread); ``receiver`` the ``BulkReceiver`` (one per receiving
socket/thread) and the ``BufferPool`` its messages land in. Used by the trainer group's signed
channel (``nexrl_hpc/trainer/protocol.py``) and its collectives.
"""
