// bundle-validate checks an OLM bundle directory with the operator-framework's own validators:
// the default bundle checks (CSV, CRDs, bundle), the OperatorHub (v2) suite and the good
// practices suite. It prints every finding and exits 1 when there is any error or warning.
//
// Usage: bundle-validate [--k8s-version 1.35] DIR
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/operator-framework/api/pkg/manifests"
	"github.com/operator-framework/api/pkg/validation"
)

func main() {
	k8sVersion := flag.String("k8s-version", "", "Kubernetes version the bundle targets (deprecated-API checks)")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: bundle-validate [--k8s-version X.Y] BUNDLE_DIR")
		os.Exit(2)
	}
	bundle, err := manifests.GetBundleFromDir(flag.Arg(0))
	if err != nil {
		fmt.Fprintf(os.Stderr, "error: cannot load the bundle: %v\n", err)
		os.Exit(1)
	}
	objs := append(bundle.ObjectsToValidate(), map[string]string{"k8s-version": *k8sVersion})

	validators := append(validation.DefaultBundleValidators,
		validation.OperatorHubV2Validator,
		validation.GoodPracticesValidator,
		validation.StandardCapabilitiesValidator,
		validation.StandardCategoriesValidator,
	)
	var errs, warns int
	for _, result := range validators.Validate(objs...) {
		for _, e := range result.Errors {
			fmt.Printf("ERROR   %s: %s\n", result.Name, e.Error())
			errs++
		}
		for _, w := range result.Warnings {
			fmt.Printf("WARNING %s: %s\n", result.Name, w.Error())
			warns++
		}
	}
	fmt.Printf("bundle-validate: %s (%s): %d errors, %d warnings\n", flag.Arg(0), bundle.Name, errs, warns)
	if errs > 0 || warns > 0 {
		os.Exit(1)
	}
}
