"""How both programs (`kubectl snapshot` and `ks-agent`) talk to a person at a terminal: `error:`/`hint:`
output and exit codes, kubectl's `-o` formats, progress bars, the text and data views of a snapshot."""
