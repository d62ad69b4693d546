"""Workarounds for hivemind's own behaviour, one module each: what it works around and the version it was
checked on are in each module's first lines. Imports nothing of swarm but ``swarm.errors``; everything else may
import it."""
