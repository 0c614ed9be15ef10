#!/usr/bin/env python3
"""The HTTP API's hostile-client checks, run against a real llava-server.

Starts the server (the default model, `--http-max-body-bytes 32 MiB`, bearer tokens on, at most
250 connections; with --tls the HTTP API on TLS with a self-signed certificate made by openssl),
samples its RSS every 10 ms, and sends each attack in turn: what the server answered, how long it
took, and the peak RSS above the idle server while it ran. Python's standard library only.

usage: scripts/http_attacks.py [--server build/llava-server] [--model models/shapes-llava] [--tls]
"""
import argparse
import base64
import gzip
import json
import os
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time
import zlib

TOKEN = "attack-test-token-0123456789"
MAX_BODY = 32 << 20
API_TLS = None  # an ssl.SSLContext when the HTTP API is on TLS (--tls)
API_PORT = 18097
CAP = 250  # --http-max-connections


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    """Peak RSS of `pid` while a `with` block runs."""

    def __init__(self, pid):
        self.pid, self.peak, self.running = pid, 0.0, False

    def __enter__(self):
        self.peak, self.running = rss_mb(self.pid), True
        self.thread = threading.Thread(target=self.loop)
        self.thread.start()
        return self

    def loop(self):
        while self.running:
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.01)

    def __exit__(self, *exc):
        time.sleep(0.2)
        self.running = False
        self.thread.join()


def connect(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if API_TLS is not None and port == API_PORT:
        s = API_TLS.wrap_socket(s, server_hostname="localhost")
    return s


def read_answer(s, timeout=10.0):
    s.settimeout(timeout)
    out = b""
    try:
        while b"\r\n\r\n" not in out:
            d = s.recv(65536)
            if not d:
                break
            out += d
    except OSError:  # a timeout, a reset, a TLS stream cut
        pass
    return out.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed, no answer)"


def send_until_refused(s, head, chunks, limit_s=20.0):
    """Sends `head` then `chunks` until the server stops taking them; bytes sent, answer."""
    s.sendall(head)
    sent, t0 = 0, time.time()
    s.settimeout(0.2)
    try:
        for c in chunks:
            if time.time() - t0 > limit_s:
                break
            s.sendall(c)
            sent += len(c)
    except OSError:  # a timeout, a reset, a TLS stream cut
        pass
    return sent, read_answer(s, 5)


def png(width, height, bit_depth=16):
    """An RGBA PNG of zeros: tiny on the wire, width*height*8 bytes decoded at 16 bits."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    row = b"\x00" + bytes(width * 4 * bit_depth // 8)
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth,
                                                              6, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def chat_body(images=(), text="Describe the image.", role="user", max_tokens=8):
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                 base64.b64encode(i).decode()}} for i in images]
    parts.append({"type": "text", "text": text})
    return json.dumps({"messages": [{"role": role, "content": parts}],
                       "max_tokens": max_tokens}).encode()


def post(port, body, token=TOKEN, extra=b""):
    s = connect(port)
    auth = b"Authorization: Bearer " + token.encode() + b"\r\n" if token else b""
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + auth + extra + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
              + body)
    answer = read_answer(s, 120)
    s.close()
    return answer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default="build/llava-server")
    ap.add_argument("--model", default="models/shapes-llava")
    ap.add_argument("--tls", action="store_true", help="the HTTP API on TLS")
    args = ap.parse_args()
    global API_TLS
    scene = open("models/examples/scene1.png", "rb").read()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = os.path.join(tmp, "tokens")
        with open(tokens, "w") as f:
            f.write(f"attacker-test {TOKEN}\n")
        tls_flags = []
        if args.tls:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                            "/CN=localhost", "-keyout", key, "-out", cert],
                           check=True, capture_output=True)
            tls_flags = ["--tls-cert", cert, "--tls-key", key]
            API_TLS = ssl.create_default_context(cafile=cert)
        log = open(os.path.join(tmp, "server.log"), "w+")
        server = subprocess.Popen(
            [args.server, "--model", args.model, "--listen", "127.0.0.1:50097",
             "--http-listen", f"127.0.0.1:{API_PORT}", "--metrics-listen", "127.0.0.1:9297",
             "--threads", "1", "--http-max-body-bytes", str(MAX_BODY), "--http-max-connections",
             str(CAP), "--auth-tokens-file", tokens] + tls_flags,
            stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(300):
                log.seek(0)
                if "serving on port" in log.read():
                    break
                time.sleep(0.1)
            port = API_PORT
            post(port, chat_body([scene]))  # warm: the first request pages weights in
            time.sleep(0.5)
            idle = rss_mb(server.pid)
            t0 = time.time()
            post(port, chat_body([scene]))
            quiet_s = time.time() - t0
            print(f"HTTP API on {'TLS' if args.tls else 'plain TCP'}; idle RSS {idle:.0f} MB; "
                  f"a normal chat alone: {quiet_s * 1e3:.0f} ms; "
                  f"--http-max-body-bytes {MAX_BODY >> 20} MiB")
            print("| attack | answer | time, s | peak RSS above idle, MB |")
            print("|---|---|---|---|")

            def row(name, fn):
                with Sampler(server.pid) as smp:
                    t = time.time()
                    answer = fn()
                    took = time.time() - t
                print(f"| {name} | {answer} | {took:.2f} | {max(0.0, smp.peak - idle):.0f} |",
                      flush=True)

            bomb = gzip.compress(bytes(256 << 20), 9)
            row(f"gzip body, {len(bomb) >> 10} KiB inflating to 256 MiB",
                lambda: post(port, bomb, extra=b"Content-Encoding: gzip\r\n"))

            def chunked_64mib():
                s = connect(port)
                piece = b"100000\r\n" + bytes(1 << 20) + b"\r\n"
                sent, answer = send_until_refused(
                    s, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + TOKEN.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n",
                    (piece for _ in range(64)))
                s.close()
                return f"{answer} after {sent >> 20} MiB sent"
            row("64 MiB chunked body", chunked_64mib)

            def endless_chunk_line():
                s = connect(port)
                sent, answer = send_until_refused(
                    s, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + TOKEN.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n",
                    (b"f" * 65536 for _ in range(1024)))
                s.close()
                return f"{answer} after {sent >> 10} KiB sent"
            row("chunk-size line without an end (64 MiB)", endless_chunk_line)

            def no_token_100mb():
                s = connect(port)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 100000000\r\n\r\n")
                answer = read_answer(s, 5)  # before a byte of the body
                s.close()
                return answer
            row("100 MB body without a token (head only sent)", no_token_100mb)
            row("gzip body without a token", lambda: post(port, bomb, token="",
                                                          extra=b"Content-Encoding: gzip\r\n"))
            row("30 MB of '[' as the JSON body", lambda: post(port, b"[" * (30 << 20)))

            def trickling():
                slow = []
                for _ in range(200):  # under the cap, leaving room for the chat
                    s = connect(port)
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: "
                              b"Bearer " + TOKEN.encode() + b"\r\nContent-Length: 100000\r\n\r\n{")
                    slow.append(s)
                time.sleep(1)
                t = time.time()
                answer = post(port, chat_body([scene]))
                took = time.time() - t
                for s in slow:
                    s.close()
                return f"{answer}; the chat beside them took {took * 1e3:.0f} ms " \
                       f"({took / quiet_s:.1f}x quiet)"
            row("200 clients trickling bodies + a normal chat", trickling)

            big = png(6000, 6000)

            def bombs():
                out = [None] * 4
                def one(i):
                    out[i] = post(port, chat_body([big]))
                ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
                for t in ts:
                    t.start()
                time.sleep(0.3)  # the bombs are being read and decoded
                t = time.time()
                chat = post(port, chat_body([scene]))
                took = time.time() - t
                for t in ts:
                    t.join()
                return f"{', '.join(sorted(set(out)))}; a normal chat beside them: {chat}, " \
                       f"{took * 1e3:.0f} ms ({took / quiet_s:.1f}x quiet)"
            row(f"4 concurrent 16-bit PNG bombs (6000x6000, {len(big) >> 10} KiB each) "
                "+ a normal chat", bombs)
            many = png(6300, 6300, 8)
            row(f"12 x 40-megapixel PNGs ({len(many) >> 10} KiB each) in one request",
                lambda: post(port, chat_body([many] * 12)))

            forged = "user\n[2026-01-01 00:00:00.000] [info] request id=forged finish=stop"
            row("a forged log line in the role", lambda: post(port, chat_body(role=forged)))
            log.seek(0)
            lines = log.read().splitlines()
            print(f"log lines starting with the forged text: "
                  f"{sum(1 for l in lines if l.startswith('[2026-01-01'))}")

            def cap():
                held = [connect(port) for _ in range(CAP + 10)]
                time.sleep(0.5)
                m = connect(9297)
                m.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                m.settimeout(5)
                text = b""
                try:
                    while True:
                        d = m.recv(65536)
                        if not d:
                            break
                        text += d
                except socket.timeout:
                    pass
                open_now = [l for l in text.decode().splitlines()
                            if l.startswith("llava_http_connections ")]
                for s in held:
                    s.close()
                return f"{open_now[0] if open_now else '?'} with {CAP + 10} opened (cap {CAP})"
            row(f"{CAP + 10} idle connections", cap)
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
