package kvevents

// Subscribed returns how many subscribers have subscribed to something, so that a
// test publishes only once its subscribers will see it.
func (p *Publisher) Subscribed() int { return p.pub.Subscribed() }

// ListenAddress is listenAddress, for the endpoint tests.
var ListenAddress = listenAddress

// DialAddress is dialAddress, for the endpoint tests.
var DialAddress = dialAddress
