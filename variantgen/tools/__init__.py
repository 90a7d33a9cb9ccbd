"""The command line and its tools: doctor, explain."""
