"""``python manage.py curve_keys --out DIR --name NAME``: a CURVE key pair for the KV-event sockets.

Writes ``DIR/NAME.key`` (the public certificate, to hand to the other side) and
``DIR/NAME.key_secret`` (the pair, readable by its owner only) with pyzmq's
``zmq.auth.create_certificates``: the files ``ingest`` (``KVCACHE_INGEST_CURVE_*``) and ``simulate``
(``--curve-*``) read. Never overwrites a key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import zmq.auth
from django.core.management.base import BaseCommand, CommandError, CommandParser

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class Command(BaseCommand):
    help = "Create a CURVE key pair (ZeroMQ certificates NAME.key and NAME.key_secret) for the KV-event port."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--out", required=True, metavar="DIR", help="Directory to write into (made if missing)."
        )
        parser.add_argument(
            "--name", required=True, help="File name stem, e.g. ingest or engine-0 (letters, digits, . _ -)."
        )

    def handle(self, *args, **options) -> None:
        name = options["name"]
        if not _NAME.fullmatch(name):
            raise CommandError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (a file name stem)")
        out = Path(options["out"])
        public, secret = out / f"{name}.key", out / f"{name}.key_secret"
        for path in (public, secret):
            if path.exists():
                raise CommandError(f"{path} exists: a key is never overwritten (remove it first)")
        try:
            out.mkdir(mode=0o700, parents=True, exist_ok=True)
            # The secret certificate is created readable by its owner only, never wider for a moment.
            old_umask = os.umask(0o077)
            try:
                zmq.auth.create_certificates(out, name)
            finally:
                os.umask(old_umask)
            public.chmod(0o644)
        except OSError as e:
            raise CommandError(f"cannot write the key pair into {out}: {e}") from None
        key = zmq.auth.load_certificate(public)[0].decode()
        self.stdout.write(f"public key {key}\n  public certificate: {public}\n  key pair (secret): {secret}")
