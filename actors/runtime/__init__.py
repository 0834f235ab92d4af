"""The actor runtime: the Actor base (one asyncio loop, one inbox, outboxes named after their
peers: actor.py) and one actor a process (process.py: how a launcher starts one, what runs
in it, and the kind -> class table of the actor roles, by name)."""
