"""Process workers: each worker a child process (`child`), started, fed and replaced by the
`ProcessRunner` (`runner`), its batches laid out in shared memory (`shared_memory`)."""
