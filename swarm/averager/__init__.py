"""The averager process: pseudo-gradient rounds (process, handle), the exact all-reduce (allreduce), codecs on the
wire (codecs, fp4, sparse), files between peers (transfer), and the process's side of audits (auditing,
audit_requests, audit_serving, repair, spill) and bans (refusals). Imports ``defence``, ``dht``, ``hivemind_fixes``
and the ground modules."""
