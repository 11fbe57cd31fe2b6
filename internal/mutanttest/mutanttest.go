// Package mutanttest checks that a conformance suite catches deliberately broken
// implementations (mutants): each mutant runs the suite in a child process of the test
// binary, since a failing subtest can not be contained inside the parent's test, and
// the child must fail in the properties named for it.
package mutanttest

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// Child returns the mutant the current process was started to run (the value of the
// environment variable env), or "" in a normal run.
func Child(env string) string { return os.Getenv(env) }

// Catches runs, for each mutant of want, the test named child of this binary in a
// child process with env set to the mutant's name, and asserts that it fails and that
// each property want names fails as a subtest of child. It does nothing inside a child.
func Catches(t *testing.T, env, child string, want map[string][]string) {
	t.Helper()
	if Child(env) != "" {
		return
	}
	for name, props := range want {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^"+child+"$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), env+"="+name)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Errorf("the suite passed mutant %s", name)
			}
			for _, prop := range props {
				if !strings.Contains(string(out), "--- FAIL: "+child+"/"+prop+" ") {
					t.Errorf("property %s did not catch mutant %s", prop, name)
				}
			}
			if t.Failed() {
				lines := strings.Split(string(out), "\n")
				t.Logf("child output:\n%s", strings.Join(lines[max(len(lines)-40, 0):], "\n"))
			}
		})
	}
}
