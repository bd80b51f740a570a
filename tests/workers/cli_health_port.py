"""Knock on TORCHELASTIC_HEALTH_CHECK_PORT while the agent runs; print what happened."""

import os
import socket

try:
    socket.create_connection(("127.0.0.1", int(os.environ["TORCHELASTIC_HEALTH_CHECK_PORT"])), timeout=5).close()
    print("health check port answered", flush=True)
except ConnectionRefusedError:
    print("health check port refused", flush=True)
