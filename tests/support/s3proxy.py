"""An HTTP proxy in front of an S3 endpoint (moto's server) that misbehaves on demand.

``mode`` is read per request: ``"ok"`` forwards; ``"5xx"`` answers 503 ``SlowDown`` as S3
does under load; ``"slow"`` waits ``slow_s`` before forwarding; ``"reset"`` resets the
client's connection (RST, no answer). Loopback only; one thread per connection.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MODES = ("ok", "5xx", "slow", "reset")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te",
              "trailer", "upgrade", "content-length"}
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultyS3Proxy:
    """``with FaultyS3Proxy("127.0.0.1", moto_port) as p: p.endpoint``; set ``p.mode``."""

    def __init__(self, upstream_host: str, upstream_port: int, slow_s: float = 1.5) -> None:
        self.mode, self.slow_s = "ok", slow_s
        self.counts = dict.fromkeys(MODES, 0)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                mode = proxy.mode
                proxy.counts[mode] += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if mode == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if mode == "5xx":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                if mode == "slow":
                    time.sleep(proxy.slow_s)
                up = http.client.HTTPConnection(upstream_host, upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in HOP_BY_HOP}
                    up.request(self.command, self.path, body=body, headers=headers)
                    reply = up.getresponse()
                    data = reply.read()
                finally:
                    up.close()
                self.send_response(reply.status, reply.reason)
                for k, v in reply.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that gave up mid-answer (its timeout): nothing to report

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FaultyS3Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Credentials and settings for moto: nothing read from the machine's own AWS files.
MOTO_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


class FaultyS3:
    """moto's S3 server on loopback holding ``root`` under ``s3://BUCKET/PREFIX``, and a
    ``FaultyS3Proxy`` in front of it: daemons get ``--s3-endpoint proxy.endpoint``."""

    def __init__(self, root: Path, bucket: str = "ramp", prefix: str = "sharded") -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.create_bucket(Bucket=bucket)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root).as_posix()}",
                              Body=path.read_bytes())
        self.url = f"s3://{bucket}/{prefix}"
        self.env = dict(MOTO_ENV)
        self.proxy = FaultyS3Proxy(host, port)

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()
