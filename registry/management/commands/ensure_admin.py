"""``python manage.py ensure_admin``: create the first staff superuser with a fresh password.

The password is generated, printed once and never stored in clear; there is no fixed default.
When a superuser exists already, nothing changes.
"""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = "Create a superuser with a freshly generated password if none exists, and print it once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username: str, **options) -> None:
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            self.stdout.write(
                "Login:     an admin account exists (password as printed when it was created; "
                f"reset with: python manage.py changepassword {username})"
            )
            return
        password = secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email="", password=password)
        self.stdout.write(f"Login:     user {username!r}, password {password!r} (shown only this once)")
