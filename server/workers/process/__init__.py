"""Process workers: each worker a child process (`child`), forked by the fork server
(`fork_server`), started, fed and replaced by the `ProcessRunner` (`runner`), its batches laid
out in shared memory (`shared_memory`)."""
