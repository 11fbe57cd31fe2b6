package zmtp

// WriteCommand sends a command, for the tests' own PINGs and SUBSCRIBEs.
func WriteCommand(c *Conn, name string, data []byte) error { return c.writeCommand(name, data) }
