package testutil

// AwaitWithin and WaitForWithin are Await and WaitFor with a time limit of their own,
// so that a test of the timeout does not wait Timeout.
var (
	AwaitWithin   = await
	WaitForWithin = waitFor
)
