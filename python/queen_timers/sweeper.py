"""The sweeper: placeholder until the sweeper issue lands."""

from __future__ import annotations

from .config import Settings


class Sweeper:
    def __init__(self, settings: Settings):
        self.settings = settings

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
