"""What can run where: the backend table, module configurations and the one resolver."""
