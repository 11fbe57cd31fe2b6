package host

import "golang.org/x/sys/windows"

// WineVersion returns the version of Wine the process runs under (ntdll's
// wine_get_version), or "" on Windows itself.
func WineVersion() string {
	p := windows.NewLazySystemDLL("ntdll.dll").NewProc("wine_get_version")
	if p.Find() != nil {
		return ""
	}
	r, _, _ := p.Call()
	if r == 0 {
		return "?"
	}
	return windows.BytePtrToString((*byte)(privatePtr(r)))
}
