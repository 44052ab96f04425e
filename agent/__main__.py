from agent.cli.main import entry

entry()
