"""One outer round: the pipeline (begin, poll, finish in named phases), its flight and report, the landing of an
overlapped round, a local round's step kept for replay, the consistency checks after a round, and when a peer ends
its round early. Imports ``state`` and below."""
