"""mbarrier pipeline classes, named barriers, the pipeline table, and the CPU protocol model
of the SM100 forward kernel. See docs/pipelines.md."""
