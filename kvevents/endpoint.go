package kvevents

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// listenAddress returns the host:port to listen on for a ZeroMQ tcp endpoint, its
// port moved up by rank as vLLM's offset_endpoint_port does for data-parallel ranks
// (an ephemeral port, "*" or 0, is left as it is).
//
// HOST is an IP address (IPv6 in brackets), "localhost" (127.0.0.1), "*" (every IPv4
// interface, libzmq's meaning) or the name of an interface (its first address), as
// libzmq accepts for a bind; host names are not looked up.
func listenAddress(endpoint string, rank int) (string, error) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("%w %q: only tcp://HOST:PORT is served", ErrEndpoint, endpoint)
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 0 {
		return "", fmt.Errorf("%w %q: no port", ErrEndpoint, endpoint)
	}
	host, portText := rest[:i], rest[i+1:]
	port := 0
	if portText != "*" {
		p, err := strconv.Atoi(portText)
		if err != nil || p < 0 || p > 65535 || portText != strconv.Itoa(p) {
			return "", fmt.Errorf("%w %q: port %q is not 0-65535 or *", ErrEndpoint, endpoint, portText)
		}
		port = p
	}
	if port != 0 && rank != 0 {
		if rank > 65535-port {
			return "", fmt.Errorf("%w %q: port %d + data-parallel rank %d is beyond 65535", ErrEndpoint, endpoint, port, rank)
		}
		port += rank
	}
	ip, err := listenIP(host)
	if err != nil {
		return "", fmt.Errorf("%w %q: %w", ErrEndpoint, endpoint, err)
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(port)), nil
}

// dialAddress returns the host:port to dial for a ZeroMQ tcp endpoint that names a
// remote socket, its port moved up by rank as for listenAddress. HOST is an IP
// address (IPv6 in brackets) or a host name, looked up at each dial; PORT is
// 1-65535.
func dialAddress(endpoint string, rank int) (string, error) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("%w %q: only tcp://HOST:PORT is dialled", ErrEndpoint, endpoint)
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 0 {
		return "", fmt.Errorf("%w %q: no port", ErrEndpoint, endpoint)
	}
	host, portText := rest[:i], rest[i+1:]
	p, err := strconv.Atoi(portText)
	if err != nil || p < 1 || p > 65535 || portText != strconv.Itoa(p) {
		return "", fmt.Errorf("%w %q: port %q is not 1-65535", ErrEndpoint, endpoint, portText)
	}
	if rank > 65535-p {
		return "", fmt.Errorf("%w %q: port %d + data-parallel rank %d is beyond 65535", ErrEndpoint, endpoint, p, rank)
	}
	if h, ok := strings.CutPrefix(host, "["); ok {
		h, ok = strings.CutSuffix(h, "]")
		if ip := net.ParseIP(h); !ok || ip == nil || ip.To4() != nil {
			return "", fmt.Errorf("%w %q: %q is not an IPv6 address in brackets", ErrEndpoint, endpoint, host)
		}
		host = h
	} else if ip := net.ParseIP(host); ip != nil && ip.To4() == nil {
		return "", fmt.Errorf("%w %q: an IPv6 address must be in brackets", ErrEndpoint, endpoint)
	} else if ip == nil && !hostName(host) {
		return "", fmt.Errorf("%w %q: %q is not an IP address or a host name", ErrEndpoint, endpoint, host)
	}
	return net.JoinHostPort(host, strconv.Itoa(p+rank)), nil
}

// hostName reports whether s is a DNS name: dot-separated labels of letters,
// digits, '-' and '_', at most 253 bytes.
func hostName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(strings.TrimSuffix(s, "."), ".") {
		if label == "" || len(label) > 63 {
			return false
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

func listenIP(host string) (net.IP, error) {
	switch host {
	case "":
		return nil, fmt.Errorf("no host (name *, an address or an interface)")
	case "*":
		return net.IPv4zero, nil
	case "localhost":
		return net.IPv4(127, 0, 0, 1), nil
	}
	if h, ok := strings.CutPrefix(host, "["); ok {
		h, ok = strings.CutSuffix(h, "]")
		ip := net.ParseIP(h)
		if !ok || ip == nil || ip.To4() != nil {
			return nil, fmt.Errorf("%q is not an IPv6 address in brackets", host)
		}
		return ip, nil
	}
	if ip := net.ParseIP(host); ip != nil {
		if ip.To4() == nil {
			return nil, fmt.Errorf("an IPv6 address must be in brackets")
		}
		return ip, nil
	}
	ifi, err := net.InterfaceByName(host)
	if err != nil {
		return nil, fmt.Errorf("%q is not an IP address, *, localhost or an interface of this host", host)
	}
	addrs, err := ifi.Addrs()
	if err != nil {
		return nil, fmt.Errorf("interface %q: %w", host, err)
	}
	// An IPv4 address first, as libzmq (without ZMQ_IPV6) takes.
	var v6 net.IP
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if n.IP.To4() != nil {
				return n.IP, nil
			}
			if v6 == nil {
				v6 = n.IP
			}
		}
	}
	if v6 != nil {
		return v6, nil
	}
	return nil, fmt.Errorf("interface %q has no address", host)
}
