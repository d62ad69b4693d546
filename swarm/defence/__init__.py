"""Defences against peers that lie, as rules over data: receipts and audits (audit), the reducer's robust mean
(robust), and bans with the accusations that spread them (bans). Imports ``dht`` (identities, records) and below;
the averager process moves the bytes these rules judge (``swarm.averager``)."""
